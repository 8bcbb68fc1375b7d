// Software prefetches for the kernels, as asm statements. GCC 12 silently drops `_mm_prefetch`
// (`__builtin_prefetch`) from some loops it vectorizes or unrolls: moving decode attention's
// prefetch into a helper once left none in its object code, at twice the time
// (benchmarks/results/kernels/history.md, "Decode attention: prefetches the compiler kept").
// An `asm volatile` cannot be dropped. A prefetch neither faults nor changes a result, so an
// address past the end of a buffer (the kernels prefetch a fixed distance ahead) is harmless.
// The pointer goes in as an address
// operand ("p", printed by %a0), not as a memory operand made from `*p`, which C++ would not
// allow past the end; the compiler still folds constant offsets into the instruction (a register
// operand cost decode attention 3-7 % where its blocks sit in cache, for the extra additions).
#pragma once

#if defined(__x86_64__) || defined(__i386__)
namespace genserve {

// PREFETCHT0: the 64-byte line holding `p` into L1 and the levels below it.
inline void prefetch_l1(const void* p) {
  asm volatile("prefetcht0 %a0" : : "p"(p));
}

// PREFETCHT1: the 64-byte line holding `p` into L2 and below, not L1.
inline void prefetch_l2(const void* p) {
  asm volatile("prefetcht1 %a0" : : "p"(p));
}

}  // namespace genserve
#endif
