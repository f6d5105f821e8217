# kernels.odr_march_symbols (cmake -P): the objects of kernels.odr_march define
# no body of encode_into or decode_attention::operator() (they call the ones in
# lynx::kernels), and calls both. Inputs: NM, OBJECTS (a ;-list).
list(FILTER OBJECTS EXCLUDE REGEX "odr_march_main")
foreach(obj IN LISTS OBJECTS)
  execute_process(COMMAND "${NM}" --defined-only -C "${obj}" OUTPUT_VARIABLE syms RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "nm failed on ${obj}")
  endif()
  string(REGEX MATCHALL "[^\n]*(encode_into<|decode_attention<[^\n]*::operator\\(\\)<)[^\n]*" bodies
         "${syms}")
  if(bodies)
    list(GET bodies 0 first)
    message(FATAL_ERROR "${obj} holds its own body of a lynx::kernels template: ${first}")
  endif()
  # and it does call them (else the check above would prove nothing)
  execute_process(COMMAND "${NM}" --undefined-only -C "${obj}" OUTPUT_VARIABLE refs)
  if(NOT refs MATCHES "encode_into<" OR NOT refs MATCHES "decode_attention<[^\n]*::operator\\(\\)<")
    message(FATAL_ERROR "${obj} does not call lynx::kernels' encode_into and decode_attention")
  endif()
endforeach()
list(LENGTH OBJECTS n)
message(STATUS "kernels.odr_march_symbols: ${n} objects call lynx::kernels' bodies, define none")
