/* The Debian guest's gcc test (images/debian/workload.c): kpin-workload compiles it with
 * the guest's gcc and runs it. Its output is deterministic: kpin-workload hashes it. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint32_t crc32_of(const uint8_t *p, size_t n) {
    uint32_t crc = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        crc ^= p[i];
        for (int b = 0; b < 8; b++)
            crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1u)));
    }
    return ~crc;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

int main(void) {
    /* Primes below 2 000 000 with a sieve. */
    enum { LIMIT = 2000000 };
    uint8_t *composite = calloc(LIMIT, 1);
    if (!composite)
        return 1;
    unsigned primes = 0;
    uint64_t prime_sum = 0;
    for (uint64_t i = 2; i < LIMIT; i++) {
        if (composite[i])
            continue;
        primes++;
        prime_sum += i;
        for (uint64_t j = i * i; j < LIMIT; j += i)
            composite[j] = 1;
    }
    printf("primes %u %llu\n", primes, (unsigned long long)prime_sum);
    printf("crc32 %08x\n", crc32_of(composite, LIMIT));
    free(composite);

    /* Sorting 200 000 numbers from a linear congruential generator. */
    enum { N = 200000 };
    uint64_t *v = malloc(N * sizeof *v);
    if (!v)
        return 1;
    uint64_t x = 42;
    for (int i = 0; i < N; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        v[i] = x >> 11;
    }
    qsort(v, N, sizeof *v, cmp_u64);
    uint64_t mix = 0;
    for (int i = 0; i < N; i++)
        mix = mix * 31 + v[i];
    printf("sort %llu %llu %llu\n", (unsigned long long)v[0], (unsigned long long)v[N - 1],
           (unsigned long long)mix);
    free(v);

    /* A double recurrence (no contraction: -O2 on x86-64 emits no FMA by default). */
    double d = 0.5;
    for (int i = 0; i < 1000000; i++)
        d = 3.7 * d * (1.0 - d);
    printf("logistic %.17g\n", d);

    char buf[64];
    snprintf(buf, sizeof buf, "%s-%d", "kpin", 2025);
    printf("string %s %zu\n", buf, strlen(buf));
    return 0;
}
