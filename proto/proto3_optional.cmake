# protoc-c 1.4 predates proto3 `optional`. protoc implements `optional T f = N;` as a one-field
# oneof named `_f`, which is identical on the wire, so protoc-c gets a copy of the contract with
# that rewrite spelled out; the generated C then tells presence by `_f_case`.
# Usage: cmake -DIN=rnnd.proto -DOUT=copy.proto -P proto3_optional.cmake
file(READ ${IN} text)
string(REGEX REPLACE "optional ([A-Za-z0-9_.]+) ([A-Za-z0-9_]+) = ([0-9]+);"
       "oneof _\\2 { \\1 \\2 = \\3; }" text "${text}")
file(WRITE ${OUT} "${text}")
