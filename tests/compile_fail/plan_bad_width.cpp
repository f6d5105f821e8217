// Must NOT compile: a code width of 10 bits is not offered (8, 12 or 16).
#include "lynx/planes/stream_plan.hpp"

int main() { return lynx::stream_plan<10, 5, 5>::streams; }
