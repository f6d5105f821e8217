// Forwarding header: the per-tile math of decode attention (exp2, folds, merge),
// shared by every backend, lives in lynx/backend/host/attention/tile_math.hpp so
// that backend/ includes nothing above it.
#pragma once

#include "lynx/backend/host/attention/tile_math.hpp"
