# cmake -DIN=delta.ptx -DOUT=delta_ptx.cpp -P embed_ptx.cmake
# Writes the PTX text as a NUL-terminated byte array (cuModuleLoadDataEx
# takes PTX as a C string): kDeltaPtx, kDeltaPtxBytes (without the NUL).
file(READ "${IN}" hex HEX)
string(LENGTH "${hex}" n)
math(EXPR bytes "${n} / 2")
# 32 bytes per line, then every byte as 0xNN,
string(REPEAT "[0-9a-f]" 64 line)
string(REGEX REPLACE "(${line})" "\\1\n" hex "${hex}")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," hex "${hex}")
file(WRITE "${OUT}.tmp"
"// Generated from lib/core/engine/kernels/delta.cu by embed_ptx.cmake: do not edit.\n"
"#include <cstddef>\n"
"namespace shmcast::detail::delta {\n"
"extern const unsigned char kDeltaPtx[];\n"
"extern const std::size_t kDeltaPtxBytes;\n"
"const unsigned char kDeltaPtx[] = {\n${hex}\n0x00};\n"
"const std::size_t kDeltaPtxBytes = ${bytes};\n"
"}  // namespace shmcast::detail::delta\n")
file(RENAME "${OUT}.tmp" "${OUT}")
