# cmake -DIN=delta.ptx -DOUT=delta_ptx.cpp [-DSYMBOL=kDeltaPtx -DNS=shmcast::detail::delta
#       -DSOURCE=delta.cu] -P embed_ptx.cmake
# Writes the PTX text as a NUL-terminated byte array (cuModuleLoadDataEx
# takes PTX as a C string): SYMBOL, SYMBOL##Bytes (without the NUL), in
# namespace NS (by default the delta kernels' names).
if(NOT SYMBOL)
  set(SYMBOL kDeltaPtx)
endif()
if(NOT NS)
  set(NS shmcast::detail::delta)
endif()
if(NOT SOURCE)
  set(SOURCE delta.cu)
endif()
file(READ "${IN}" hex HEX)
string(LENGTH "${hex}" n)
math(EXPR bytes "${n} / 2")
# 32 bytes per line, then every byte as 0xNN,
string(REPEAT "[0-9a-f]" 64 line)
string(REGEX REPLACE "(${line})" "\\1\n" hex "${hex}")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," hex "${hex}")
file(WRITE "${OUT}.tmp"
"// Generated from lib/core/engine/kernels/${SOURCE} by embed_ptx.cmake: do not edit.\n"
"#include <cstddef>\n"
"namespace ${NS} {\n"
"extern const unsigned char ${SYMBOL}[];\n"
"extern const std::size_t ${SYMBOL}Bytes;\n"
"const unsigned char ${SYMBOL}[] = {\n${hex}\n0x00};\n"
"const std::size_t ${SYMBOL}Bytes = ${bytes};\n"
"}  // namespace ${NS}\n")
file(RENAME "${OUT}.tmp" "${OUT}")
