/* kvx_bench — how fast a KV pool moves between two processes over UCX.
 *
 *   kvx_bench [--pool-mib N] [--block B[,B...]] [--tls T[,T...]] [--iters N] [--no-am]
 *             [--no-ucx-target]
 *
 * The parent is the writer (a prefill replica); a child it re-executes is the
 * target (a decode replica) with a registered pool of the same size. For each
 * transport and block size the parent writes the whole pool:
 *   put: pd_kvx_put_batch of every block (ucp_put_nbx each), then
 *        pd_kvx_flush; timed from the first put to the flush callback, so
 *        the bytes are visible in the target's memory;
 *   am:  pd_kvx_am_write of every block into one reservation, then
 *        pd_kvx_am_complete; timed until the target reports the claim
 *        accepted (every byte landed after validation).
 * The target pool is malloc'd (as the KV cache is today), and then, for
 * puts, allocated by UCX (pd_kvx_alloc_pool: shared memory on one host).
 * The ceiling is memcpy of the same bytes between two buffers in one process.
 * GB/s are 1e9 bytes per second, best of --iters (median printed too).
 * Default blocks: 64 tokens x 61 layers x 576 values x 4 bytes (8,994,816 B,
 * one DeepSeek-V3 KV block in fp32) and 256 KiB. */
#include "kvx_sock.h"
#include "pd_kvtransfer.h"

#include <sys/wait.h>

enum {
    MSG_ADDR = 1,
    MSG_RKEY,
    MSG_VERIFY,
    MSG_RESULT,
    MSG_EXIT,
    MSG_AMSETUP,
    MSG_AMREADY,
    MSG_AMDONE
};

#define V3_BLOCK ((size_t)64 * 61 * 576 * 4)
#define WRITER   1

static void die(const char *what, const char *msg) {
    fprintf(stderr, "kvx_bench: %s: %s\n", what, msg);
    exit(1);
}

static uint8_t *alloc_touched(size_t bytes, int fill) {
    uint8_t *p = aligned_alloc(4096, bytes);
    if (!p)
        die("alloc", "out of memory");
    memset(p, fill, bytes);
    return p;
}

static void fill_seq(uint8_t *p, size_t bytes, uint64_t seed) {
    uint64_t x = seed;
    for (size_t i = 0; i + 8 <= bytes; i += 8) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        memcpy(p + i, &x, 8);
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* ---- the target (child) ---------------------------------------------------- */

typedef struct {
    int fd;
    uint64_t resv;
    bool done;
} target_state;

static void tgt_blocks_free(void *user, const char *rid, uint64_t resv, const int32_t *b,
                            size_t n) {
    (void)user, (void)rid, (void)resv, (void)b, (void)n;
}

static void tgt_am_event(void *user, const char *rid, uint64_t resv, pd_kvx_verdict v,
                         const char *detail) {
    (void)rid;
    target_state *s = user;
    if (v != PD_KVX_ACCEPTED)
        fprintf(stderr, "target: refused: %s\n", detail);
    uint32_t ok = v == PD_KVX_ACCEPTED;
    if (resv == s->resv)
        kvx_sock_send(s->fd, MSG_AMDONE, &ok, sizeof ok);
}

static int target_main(const char *tls, const char *mem_kind, size_t bytes) {
    target_state s = {.fd = 3};
    pd_kvx_config cfg = {
        .name = "bench-target", .transports = tls, .net_devices = strcmp(tls, "tcp") ? NULL : "lo"};
    pd_kvx_agent *a = NULL;
    pd_kvx_pool *pool = NULL;
    pd_kvx_reservations *tab = NULL;
    pd_err e = {{0}};
    bool ucx_mem = !strcmp(mem_kind, "ucx");
    uint8_t *heap = ucx_mem ? NULL : alloc_touched(bytes, 0), *mem = heap;
    if (pd_kvx_agent_init(&cfg, &a, &e) != PD_OK ||
        (ucx_mem ? pd_kvx_alloc_pool(a, bytes, &pool, &e)
                 : pd_kvx_register_pool(a, mem, bytes, &pool, &e)) != PD_OK)
        die("target", e.msg);
    if (ucx_mem) {
        mem = pd_kvx_pool_base(pool);
        memset(mem, 0, bytes);
    }
    const void *addr, *rk;
    size_t alen, rkl;
    pd_kvx_agent_worker_address(a, &addr, &alen);
    pd_kvx_pool_rkey(pool, &rk, &rkl);
    kvx_sock_send(s.fd, MSG_ADDR, addr, (uint32_t)alen);
    kvx_sock_send(s.fd, MSG_RKEY, rk, (uint32_t)rkl);
    int32_t *blocks = NULL;
    int wait_ms = getenv("KVX_BENCH_WAIT_MS") ? atoi(getenv("KVX_BENCH_WAIT_MS")) : 1000;
    for (;;) {
        while (pd_kvx_agent_progress(a)) {
        }
        struct pollfd pfd[2] = {{pd_kvx_agent_event_fd(a), POLLIN, 0}, {s.fd, POLLIN, 0}};
        poll(pfd, 2, wait_ms);
        if (!(pfd[1].revents & (POLLIN | POLLHUP)))
            continue;
        uint32_t ty, len;
        void *buf;
        if (kvx_sock_recv(s.fd, &ty, &buf, &len, 5000) != 0)
            break;
        if (ty == MSG_VERIFY) {
            uint64_t seed, res = 0;
            memcpy(&seed, buf, 8);
            uint8_t *want = alloc_touched(bytes, 0);
            fill_seq(want, bytes, seed);
            for (size_t i = 0; i < bytes && !res; i++)
                if (want[i] != mem[i])
                    res = i + 1;
            free(want);
            kvx_sock_send(s.fd, MSG_RESULT, &res, sizeof res);
        } else if (ty == MSG_AMSETUP) { /* block bytes, block count: one reservation */
            uint64_t bb[2];
            memcpy(bb, buf, sizeof bb);
            if (!tab) {
                pd_kvx_resv_config rc = {.blocks_free = tgt_blocks_free,
                                         .on_am_event = tgt_am_event,
                                         .user = &s,
                                         .block_bytes = bb[0]};
                if (pd_kvx_resv_init(&rc, &tab, &e) != PD_OK ||
                    pd_kvx_agent_accept_writes(a, tab, pool, &e) != PD_OK)
                    die("target", e.msg);
            }
            free(blocks);
            blocks = malloc(bb[1] * sizeof *blocks);
            for (uint64_t i = 0; i < bb[1]; i++)
                blocks[i] = (int32_t)i;
            if (pd_kvx_resv_create(tab, "bench", WRITER, blocks, bb[1], 600, pd_now_s(),
                                   PD_KVX_RESV_AM, &s.resv, &e) != PD_OK)
                die("target", e.msg);
            kvx_sock_send(s.fd, MSG_AMREADY, &s.resv, sizeof s.resv);
        }
        free(buf);
        if (ty == MSG_EXIT)
            break;
    }
    free(blocks);
    pd_kvx_pool_free(&pool);
    pd_kvx_agent_free(&a);
    pd_kvx_resv_free(&tab);
    free(heap);
    return 0;
}

/* ---- the writer (parent) ---------------------------------------------------- */

typedef struct {
    int done;
    pd_status st;
} completion;

static void on_done(void *user, uint64_t tag, pd_status st) {
    (void)tag;
    completion *c = user;
    c->done++;
    if (st != PD_OK)
        c->st = st;
}

static void *expect(int fd, uint32_t type, uint32_t *len_p) {
    uint32_t ty = 0, len = 0;
    void *buf = NULL;
    if (kvx_sock_recv(fd, &ty, &buf, &len, 60000) != 0 || ty != type)
        die("child", "no answer (see its messages above)");
    if (len_p)
        *len_p = len;
    return buf;
}

/* Progresses the writer until want operations completed (or a socket
 * message arrives when want < 0). */
static void drive(pd_kvx_agent *a, completion *c, int want, int fd) {
    double until = pd_now_s() + 120;
    for (;;) {
        bool more = pd_kvx_agent_progress(a);
        if (want >= 0 && c->done >= want)
            return;
        struct pollfd pfd[2] = {{pd_kvx_agent_event_fd(a), POLLIN, 0}, {fd, POLLIN, 0}};
        if (want < 0) {
            if (poll(&pfd[1], 1, 0) > 0)
                return;
        }
        if (pd_now_s() > until)
            die("writer", "no completion in 120 s");
        if (!more)
            poll(pfd, want < 0 ? 2 : 1, 100);
    }
}

typedef struct {
    double best, median;
} rate;

static rate summarize(double *gbps, int n) {
    qsort(gbps, (size_t)n, sizeof *gbps, cmp_double);
    return (rate){gbps[n - 1], gbps[n / 2]};
}

static rate bench_memcpy(uint8_t *dst, const uint8_t *src, size_t block, size_t nblocks,
                         int iters) {
    double g[16];
    for (int it = 0; it < iters; it++) {
        double t0 = pd_now_s();
        for (size_t i = 0; i < nblocks; i++)
            memcpy(dst + i * block, src + i * block, block);
        g[it] = (double)(block * nblocks) / (pd_now_s() - t0) / 1e9;
    }
    return summarize(g, iters);
}

static rate bench_put(pd_kvx_agent *a, pd_kvx_peer *p, uint8_t *src, size_t block, size_t nblocks,
                      int iters) {
    pd_kvx_iov *iov = calloc(nblocks, sizeof *iov);
    for (size_t i = 0; i < nblocks; i++)
        iov[i] = (pd_kvx_iov){src + i * block, i * block, block};
    double g[16];
    pd_err e = {{0}};
    for (int it = 0; it < iters; it++) {
        completion c = {0};
        double t0 = pd_now_s();
        if (pd_kvx_put_batch(p, iov, nblocks, 0, on_done, &c, &e) != PD_OK ||
            pd_kvx_flush(p, 1, on_done, &c, &e) != PD_OK)
            die("put", e.msg);
        drive(a, &c, 2, -1);
        if (c.st != PD_OK)
            die("put", "an operation failed");
        g[it] = (double)(block * nblocks) / (pd_now_s() - t0) / 1e9;
    }
    free(iov);
    return summarize(g, iters);
}

static rate bench_am(pd_kvx_agent *a, pd_kvx_peer *p, int fd, uint8_t *src, size_t block,
                     size_t nblocks, int iters) {
    pd_kvx_block_write *w = calloc(nblocks, sizeof *w);
    for (size_t i = 0; i < nblocks; i++)
        w[i] = (pd_kvx_block_write){src + i * block, (uint32_t)i, 0, (uint32_t)block};
    double g[16];
    pd_err e = {{0}};
    for (int it = 0; it < iters; it++) {
        uint64_t setup[2] = {block, nblocks};
        kvx_sock_send(fd, MSG_AMSETUP, setup, sizeof setup);
        uint64_t *resv = expect(fd, MSG_AMREADY, NULL);
        completion c = {0};
        double t0 = pd_now_s();
        if (pd_kvx_am_write(p, "bench", *resv, WRITER, w, nblocks, 0, on_done, &c, &e) != PD_OK ||
            pd_kvx_am_complete(p, "bench", *resv, WRITER, (uint64_t)block * nblocks, 1, on_done, &c,
                               &e) != PD_OK)
            die("am", e.msg);
        drive(a, &c, -1, fd); /* until the target says the claim was accepted */
        double dt = pd_now_s() - t0;
        uint32_t *ok = expect(fd, MSG_AMDONE, NULL);
        if (!*ok)
            die("am", "the target refused the claim");
        drive(a, &c, 2, -1);
        g[it] = (double)(block * nblocks) / dt / 1e9;
        free(ok);
        free(resv);
    }
    free(w);
    return summarize(g, iters);
}

static size_t parse_list(const char *s, size_t *out, size_t cap) {
    size_t n = 0;
    while (*s && n < cap) {
        out[n++] = strtoull(s, (char **)&s, 10);
        if (*s == ',')
            s++;
    }
    return n;
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--kvx-child"))
        _exit(target_main(argv[3], argv[4], strtoull(argv[5], NULL, 10)));
    signal(SIGPIPE, SIG_IGN);
    size_t pool_mib = 1024, blocks[8] = {V3_BLOCK, 256 * 1024};
    size_t nbs = 2;
    int iters = 3;
    bool am = true, ucx_target = true;
    char tls_list[128] = "shm,tcp";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--pool-mib") && i + 1 < argc)
            pool_mib = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--block") && i + 1 < argc)
            nbs = parse_list(argv[++i], blocks, 8);
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc)
            iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--tls") && i + 1 < argc)
            snprintf(tls_list, sizeof tls_list, "%s", argv[++i]);
        else if (!strcmp(argv[i], "--no-am"))
            am = false;
        else if (!strcmp(argv[i], "--no-ucx-target"))
            ucx_target = false;
        else {
            fprintf(stderr, "usage: kvx_bench [--pool-mib N] [--block B[,B...]] [--tls T[,T...]] "
                            "[--iters N<=16] [--no-am] [--no-ucx-target]\n");
            return 2;
        }
    }
    if (iters < 1 || iters > 16 || nbs == 0)
        die("args", "bad --iters or --block");
    pd_log_set_level(PD_LOG_WARN);
    size_t pool = pool_mib << 20;
    uint8_t *src = alloc_touched(pool, 1), *dst = alloc_touched(pool, 0);
    const uint64_t seed = 2024;
    fill_seq(src, pool, seed);

    printf("pool %zu MiB, %d iterations, GB/s = 1e9 B/s (best / median)\n", pool_mib, iters);
    printf("%-6s %-7s %-7s %10s %7s %10s %10s %9s\n", "tls", "path", "target", "block B", "blocks",
           "GB/s best", "median", "of memcpy");
    double ceiling[8];
    for (size_t b = 0; b < nbs; b++) {
        size_t nblocks = pool / blocks[b];
        rate r = bench_memcpy(dst, src, blocks[b], nblocks, iters);
        ceiling[b] = r.best;
        printf("%-6s %-7s %-7s %10zu %7zu %10.2f %10.2f %8.0f%%\n", "-", "memcpy", "malloc",
               blocks[b], nblocks, r.best, r.median, 100.0);
    }
    free(dst);

    /* A fresh target per transport and block size (its reservation table
     * has one block size). */
    for (char *save = NULL, *tls = strtok_r(tls_list, ",", &save); tls;
         tls = strtok_r(NULL, ",", &save)) {
        for (size_t job = 0; job < 2 * nbs; job++) {
            size_t b = job % nbs;
            /* malloc'd target pool (what the KV cache is today), then one
             * allocated by UCX (pd_kvx_alloc_pool): puts only */
            const char *mem_kind = job < nbs ? "malloc" : "ucx";
            if (job >= nbs && !ucx_target)
                break;
            char bytes_arg[32];
            snprintf(bytes_arg, sizeof bytes_arg, "%zu", pool);
            int fd;
            pid_t pid = kvx_spawn_child("target", tls, mem_kind, bytes_arg, &fd);
            if (pid < 0)
                die("spawn", strerror(errno));
            pd_kvx_config cfg = {.name = "bench-writer",
                                 .transports = tls,
                                 .net_devices = strcmp(tls, "tcp") ? NULL : "lo"};
            pd_kvx_agent *a = NULL;
            pd_kvx_pool *sp = NULL;
            pd_kvx_peer *peer = NULL;
            pd_err e = {{0}};
            if (pd_kvx_agent_init(&cfg, &a, &e) != PD_OK ||
                pd_kvx_register_pool(a, src, pool, &sp, &e) != PD_OK)
                die(tls, e.msg);
            uint32_t len;
            void *addr = expect(fd, MSG_ADDR, &len);
            if (pd_kvx_peer_connect(a, addr, len, NULL, &peer, &e) != PD_OK)
                die(tls, e.msg);
            void *rk = expect(fd, MSG_RKEY, &len);
            if (pd_kvx_peer_add_rkey(peer, rk, len, &e) != PD_OK)
                die(tls, e.msg);
            free(addr);
            free(rk);
            size_t nblocks = pool / blocks[b];
            rate r = bench_put(a, peer, src, blocks[b], nblocks, iters);
            printf("%-6s %-7s %-7s %10zu %7zu %10.2f %10.2f %8.0f%%\n", tls, "put", mem_kind,
                   blocks[b], nblocks, r.best, r.median, 100 * r.best / ceiling[b]);
            fflush(stdout);
            /* The bytes really arrived: the target compares its pool. */
            kvx_sock_send(fd, MSG_VERIFY, &seed, sizeof seed);
            uint64_t *res = expect(fd, MSG_RESULT, NULL);
            if (*res && *res - 1 < nblocks * blocks[b])
                die(tls, "the target's pool differs from the source");
            free(res);
            if (am && job < nbs) {
                r = bench_am(a, peer, fd, src, blocks[b], nblocks, iters);
                printf("%-6s %-7s %-7s %10zu %7zu %10.2f %10.2f %8.0f%%\n", tls, "am", mem_kind,
                       blocks[b], nblocks, r.best, r.median, 100 * r.best / ceiling[b]);
                fflush(stdout);
            }
            kvx_sock_send(fd, MSG_EXIT, NULL, 0);
            pd_kvx_peer_close(&peer);
            for (int i = 0; i < 10; i++)
                pd_kvx_agent_progress(a);
            pd_kvx_pool_free(&sp);
            pd_kvx_agent_free(&a);
            int status;
            waitpid(pid, &status, 0);
            close(fd);
        }
    }
    free(src);
    return 0;
}
