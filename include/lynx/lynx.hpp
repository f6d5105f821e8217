// Lynx: progressive KV-cache transfer for disaggregated LLM inference.
// The umbrella header: everything host-side. CUDA kernels: lynx/backend/cuda/*.cuh.
#pragma once

#include "lynx/core/buffer.hpp"
#include "lynx/core/config.hpp"
#include "lynx/core/dispatch.hpp"
#include "lynx/core/error.hpp"
#include "lynx/core/memory.hpp"
#include "lynx/core/types.hpp"
#include "lynx/core/view.hpp"
#include "lynx/planes/bitplane.hpp"
#include "lynx/planes/codec.hpp"
#include "lynx/planes/layout.hpp"
#include "lynx/planes/segment.hpp"
#include "lynx/planes/stream_plan.hpp"
#include "lynx/planes/tensor.hpp"
#include "lynx/quant/quantizer.hpp"
#include "lynx/speculation/engine.hpp"
#include "lynx/speculation/random.hpp"
#include "lynx/speculation/session.hpp"
#include "lynx/speculation/verifier.hpp"
