// Must NOT compile with -ffast-math: Lynx's bitwise exactness and its checks of
// non-finite input do not survive it (include/lynx/core/config.hpp).
#include "lynx/lynx.hpp"

int main() { return 0; }
