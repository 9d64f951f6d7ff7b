/* Kernels for bench/host_resources.py: each stresses one resource of the core it runs on, so that which of them
   slows down in the host's slow spells names the resource another tenant is taking. */
#include <stdint.h>

/* n rounds of 16 dependent multiplies: 48 cycles a round at any clock (3-cycle latency), so its wall time gives
   the core's effective clock. It keeps one port busy a third of the time: a competing hyperthread barely slows it. */
uint64_t clock_chain(uint64_t n, uint64_t x) {
    for (uint64_t i = 0; i < n; i++) {
        __asm__ volatile(
            "imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0\n\t"
            "imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0\n\t"
            "imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0\n\t"
            "imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0\n\t" : "+r"(x));
    }
    return x;
}

/* n rounds of 16 register adds in 4 independent chains: near 4 per cycle, it fills the ALU ports, so it slows when
   a hyperthread on the same physical core competes for them. (Register operands: adds of small immediates can be
   folded at rename on recent Intel cores and would not reach the ports.) */
uint64_t alu_wide(uint64_t n, uint64_t a) {
    uint64_t b = a + 1, c = a + 2, d = a + 3, k = 7;
    for (uint64_t i = 0; i < n; i++) {
        __asm__ volatile(
            "add %4, %0\n\tadd %4, %1\n\tadd %4, %2\n\tadd %4, %3\n\t"
            "add %4, %0\n\tadd %4, %1\n\tadd %4, %2\n\tadd %4, %3\n\t"
            "add %4, %0\n\tadd %4, %1\n\tadd %4, %2\n\tadd %4, %3\n\t"
            "add %4, %0\n\tadd %4, %1\n\tadd %4, %2\n\tadd %4, %3\n\t"
            : "+r"(a), "+r"(b), "+r"(c), "+r"(d) : "r"(k));
    }
    return a + b + c + d;
}

/* n dependent loads around a random cycle in buf: the load latency of whichever cache level holds buf. */
uint64_t pointer_walk(const uint64_t *buf, uint64_t n) {
    uint64_t j = 0;
    for (uint64_t i = 0; i < n; i++) j = buf[j];
    return j;
}
