/*
 * pa_cache: a QEMU TCG plugin (system mode, one vCPU) that simulates kpin cachesim's
 * hierarchy over guest-physical addresses, for the side-by-side benchmark
 * (tests/bench/side_by_side.py --configs qemu-cache). Written for kpin; not QEMU's
 * contrib/plugins/cache.c, which tags instructions by a host pointer.
 *
 * Geometry: L1I and L1D 16 KiB 8-way, LL 2 MiB 16-way, 64-byte lines, LRU, non-inclusive
 * (an L1 miss goes to LL), write-allocate; an access that crosses a line touches each
 * line; one fetch per executed instruction; I/O accesses are not simulated (counted).
 *
 * Addresses: data by qemu_plugin_hwaddr_phys_addr. Instructions: QEMU 7.2's plugin API
 * has no physical address for an instruction, only qemu_plugin_insn_haddr, a host
 * pointer into the RAM block the code was translated from. The plugin finds the guest's
 * RAM block in /proc/self/maps (the one anonymous read-write mapping of exactly the
 * guest's RAM size, `ram=` MiB) and takes PA = host pointer - block start: on a pc
 * machine with RAM under 3 GiB the RAM block's offset is the physical address. Code
 * outside that block (the BIOS ROM) is tagged by its host pointer in a separate space
 * and counted. The translation is done once per instruction at translation time.
 *
 * Args: ram=MIB (default 256), out=PATH (default stderr).
 */
#include <glib.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <qemu-plugin.h>

QEMU_PLUGIN_EXPORT int qemu_plugin_version = QEMU_PLUGIN_VERSION;

#define LINE_SHIFT 6

typedef struct {
    const char *name;
    uint32_t sets, assoc;
    uint64_t *tags;   /* sets * assoc: line + 1, 0 invalid */
    uint64_t *stamps; /* last use */
    uint64_t clock;
    uint64_t hits, misses;
} Cache;

static Cache l1i, l1d, ll;
static uint64_t fetches, data_refs, io_refs, rom_fetches;
static uint64_t ram_base, ram_size = 256ull << 20;
static const char *out_path;

static void cache_init(Cache *c, const char *name, uint64_t size, uint32_t assoc)
{
    c->name = name;
    c->assoc = assoc;
    c->sets = (uint32_t)((size >> LINE_SHIFT) / assoc);
    c->tags = g_new0(uint64_t, (gsize)c->sets * assoc);
    c->stamps = g_new0(uint64_t, (gsize)c->sets * assoc);
}

static bool cache_access(Cache *c, uint64_t line)
{
    uint64_t tag = line + 1;
    uint64_t *t = c->tags + (line & (c->sets - 1)) * c->assoc;
    uint64_t *s = c->stamps + (line & (c->sets - 1)) * c->assoc;
    uint32_t w, victim = 0;
    c->clock++;
    for (w = 0; w < c->assoc; w++) {
        if (t[w] == tag) {
            s[w] = c->clock;
            c->hits++;
            return true;
        }
    }
    c->misses++;
    for (w = 0; w < c->assoc; w++) {
        if (t[w] == 0) {
            victim = w;
            goto fill;
        }
        if (s[w] < s[victim]) {
            victim = w;
        }
    }
fill:
    t[victim] = tag;
    s[victim] = c->clock;
    return false;
}

static void reference(Cache *l1, uint64_t pa, unsigned size)
{
    uint64_t line = pa >> LINE_SHIFT, last = (pa + size - 1) >> LINE_SHIFT;
    for (; line <= last; line++) {
        if (!cache_access(l1, line)) {
            cache_access(&ll, line);
        }
    }
}

/* Per translated instruction: its physical address and length. */
typedef struct {
    uint64_t pa;
    uint32_t size;
} Insn;

static void vcpu_insn_exec(unsigned int vcpu_index, void *udata)
{
    Insn *i = udata;
    fetches++;
    reference(&l1i, i->pa, i->size);
}

static void vcpu_mem_access(unsigned int vcpu_index, qemu_plugin_meminfo_t info,
                            uint64_t vaddr, void *udata)
{
    struct qemu_plugin_hwaddr *hw = qemu_plugin_get_hwaddr(info, vaddr);
    unsigned size = 1u << qemu_plugin_mem_size_shift(info);
    if (hw == NULL || qemu_plugin_hwaddr_is_io(hw)) {
        io_refs++;
        return;
    }
    data_refs++;
    reference(&l1d, qemu_plugin_hwaddr_phys_addr(hw), size);
}

/* The guest RAM block: the read-write anonymous mapping of exactly ram_size bytes. */
static void find_ram(void)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    if (f == NULL) {
        return;
    }
    while (fgets(line, sizeof line, f)) {
        uint64_t lo, hi;
        char perms[8];
        int n = 0;
        if (sscanf(line, "%" SCNx64 "-%" SCNx64 " %7s %*s %*s %*s%n", &lo, &hi, perms, &n) < 3) {
            continue;
        }
        bool anon = line[n] == '\n' || line[n] == '\0' || strspn(line + n, " \n") == strlen(line + n);
        if (hi - lo == ram_size && perms[0] == 'r' && perms[1] == 'w' && anon) {
            ram_base = lo;
            break;
        }
    }
    fclose(f);
}

static void vcpu_tb_trans(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    size_t n = qemu_plugin_tb_n_insns(tb);
    if (ram_base == 0) {
        find_ram();
    }
    for (size_t k = 0; k < n; k++) {
        struct qemu_plugin_insn *insn = qemu_plugin_tb_get_insn(tb, k);
        uint64_t host = (uint64_t)(uintptr_t)qemu_plugin_insn_haddr(insn);
        Insn *i = g_new(Insn, 1);
        i->size = (uint32_t)qemu_plugin_insn_size(insn);
        if (ram_base != 0 && host - ram_base < ram_size) {
            i->pa = host - ram_base;
        } else {
            /* Not RAM (the BIOS ROM): a tag space of its own. */
            i->pa = (1ull << 62) | host;
            rom_fetches++;
        }
        qemu_plugin_register_vcpu_insn_exec_cb(insn, vcpu_insn_exec,
                                               QEMU_PLUGIN_CB_NO_REGS, i);
        qemu_plugin_register_vcpu_mem_cb(insn, vcpu_mem_access, QEMU_PLUGIN_CB_NO_REGS,
                                         QEMU_PLUGIN_MEM_RW, NULL);
    }
}

static void print_cache(FILE *f, const Cache *c)
{
    uint64_t all = c->hits + c->misses;
    fprintf(f, "%s hits=%" PRIu64 " misses=%" PRIu64 " miss_rate=%.4f%%\n", c->name,
            c->hits, c->misses, all ? 100.0 * c->misses / all : 0.0);
}

static void plugin_exit(qemu_plugin_id_t id, void *p)
{
    FILE *f = out_path ? fopen(out_path, "w") : stderr;
    if (f == NULL) {
        f = stderr;
    }
    fprintf(f, "pa_cache refs=%" PRIu64 " fetches=%" PRIu64 " data=%" PRIu64
            " io_not_simulated=%" PRIu64 " ram_base=%#" PRIx64
            " insns_translated_outside_ram=%" PRIu64 "\n",
            fetches + data_refs, fetches, data_refs, io_refs, ram_base, rom_fetches);
    print_cache(f, &l1i);
    print_cache(f, &l1d);
    print_cache(f, &ll);
    if (f != stderr) {
        fclose(f);
    }
}

QEMU_PLUGIN_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info,
                                           int argc, char **argv)
{
    for (int k = 0; k < argc; k++) {
        if (g_str_has_prefix(argv[k], "ram=")) {
            ram_size = g_ascii_strtoull(argv[k] + 4, NULL, 10) << 20;
        } else if (g_str_has_prefix(argv[k], "out=")) {
            out_path = g_strdup(argv[k] + 4);
        } else {
            fprintf(stderr, "pa_cache: unknown argument %s\n", argv[k]);
            return -1;
        }
    }
    if (!info->system_emulation) {
        fprintf(stderr, "pa_cache: system mode only\n");
        return -1;
    }
    cache_init(&l1i, "L1I", 16 << 10, 8);
    cache_init(&l1d, "L1D", 16 << 10, 8);
    cache_init(&ll, "LL", 2 << 20, 16);
    qemu_plugin_register_vcpu_tb_trans_cb(id, vcpu_tb_trans);
    qemu_plugin_register_atexit_cb(id, plugin_exit, NULL);
    return 0;
}
