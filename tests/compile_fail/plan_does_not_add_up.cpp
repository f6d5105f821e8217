// Must NOT compile: the stream widths (4 + 3) do not add up to the code width 8.
// tests/CMakeLists.txt runs the compiler on this file and expects the
// static_assert's message.
#include "lynx/planes/stream_plan.hpp"

int main() { return lynx::stream_plan<8, 4, 3>::streams; }
