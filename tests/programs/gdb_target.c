/*
 * The program tests/linux_gdb_in_guest.rs debugs with a scripted gdb, natively on the
 * host and inside the guest under kpin: a software breakpoint on `work`, single steps,
 * a hardware watchpoint on `counter`, and a hardware breakpoint on `finish_up`.
 */
#include <stdio.h>

volatile long counter;

__attribute__((noinline)) long work(long n)
{
    long s = 0;
    for (long i = 0; i < n; i++) {
        s += i;
        counter = s;
    }
    return s;
}

__attribute__((noinline)) void finish_up(long s)
{
    printf("sum %ld\n", s);
}

int main(void)
{
    finish_up(work(5));
    return 0;
}
