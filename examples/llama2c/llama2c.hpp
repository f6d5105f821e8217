// Umbrella header: a llama2.c model (load or built-in), its tokenizer, a
// batch-invariant CPU engine with pluggable attention, and generation helpers.
#pragma once

#include "forward.hpp"
#include "model.hpp"
#include "sampling.hpp"
#include "tokenizer.hpp"
