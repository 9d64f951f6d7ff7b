#include <stdint.h>
/* n rounds of 16 dependent multiplies: 48 cycles a round at any clock, so wall time gives the core's effective
   clock; one multiply port used a third of the time, so a busy sibling hyperthread hardly slows it. */
uint64_t chain(uint64_t n, uint64_t x) {
    for (uint64_t i = 0; i < n; i++) {
        __asm__ volatile(
            "imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0\n\t"
            "imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0\n\t"
            "imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0\n\t"
            "imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0\n\t" : "+r"(x));
    }
    return x;
}
/* n rounds of 4 independent add chains, 4 deep (16 adds, 4 cycles a round at 4 per cycle): saturates the ALU
   ports, so it slows when a sibling hyperthread competes for them. */
uint64_t wide(uint64_t n, uint64_t a) {
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
/* n dependent loads through a random cycle in buf: the latency of whichever cache level holds buf. */
uint64_t walk(const uint64_t *buf, uint64_t n) {
    uint64_t j = 0;
    for (uint64_t i = 0; i < n; i++) j = buf[j];
    return j;
}
