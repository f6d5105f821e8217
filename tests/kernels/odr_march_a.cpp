// kernels.odr_march, first object: built for the x86-64 baseline.
#include "odr_march.hpp"

std::vector<std::byte> odr_march_baseline() { return odr_march_run(); }
