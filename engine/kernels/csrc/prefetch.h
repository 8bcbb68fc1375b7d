// Software prefetches for the kernels, as asm statements. GCC 12 silently drops `_mm_prefetch`
// (`__builtin_prefetch`) from some loops it vectorizes or unrolls: moving decode attention's
// prefetch into a helper once left none in its object code, at twice the time
// (docs/benchmarks/kernels.md, "prefetches the compiler kept"). An `asm volatile` cannot be
// dropped. A prefetch neither faults nor changes a result, so an address past the end of a buffer
// (the kernels prefetch a fixed distance ahead) is harmless.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
namespace genserve {

// PREFETCHT0: the 64-byte line holding `p` into L1 and the levels below it.
inline void prefetch_l1(const void* p) {
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
}

// PREFETCHT1: the 64-byte line holding `p` into L2 and below, not L1.
inline void prefetch_l2(const void* p) {
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
}

}  // namespace genserve
#endif
