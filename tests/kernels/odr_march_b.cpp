// kernels.odr_march, second object: built with -march=native.
#include "odr_march.hpp"

std::vector<std::byte> odr_march_native() { return odr_march_run(); }
