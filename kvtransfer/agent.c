/* The agent: one ucp context and one worker per replica rank, the event fd
 * the service's loop watches, progress, and registered pools.
 *
 * Event fd. The service watches one fd: an epoll set holding the worker's
 * own fd (ucp_worker_get_efd), an eventfd we signal when callbacks are due
 * outside progress, and a pidfd per same-host peer (readable when that
 * process exits). Progress follows the UCX wake-up recipe: drain
 * ucp_worker_progress, then ucp_worker_arm; BUSY means "progress again". */
#include "kvx_impl.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

/* The worker-address blob: this header, then the UCX worker address. */
#define KVX_ADDR_MAGIC   0x4158564bu /* "KVXA" */
#define KVX_RKEY_MAGIC   0x5258564bu /* "KVXR" */
#define KVX_BLOB_VERSION 1

typedef struct {
    uint32_t magic;
    uint16_t version;
    uint16_t hdr_len;
    uint32_t pid;
    uint32_t ucx_len;
    uint64_t host_id; /* hash of the kernel boot id: "same host" */
    uint64_t pidns;   /* pid namespace inode: "pids mean the same thing" */
} kvx_addr_hdr;

/* The remote-key blob: this header, then the packed UCX rkey. */
typedef struct {
    uint32_t magic;
    uint16_t version;
    uint16_t hdr_len;
    uint64_t base;  /* the pool's address in the owner's address space */
    uint64_t bytes; /* the pool's size */
    uint32_t rkey_len;
    uint32_t reserved;
} kvx_rkey_hdr;

/* ---- op lists ------------------------------------------------------------ */

void kvx_op_list_init(kvx_op_list *l) {
    l->head.next = l->head.prev = &l->head;
}

bool kvx_op_list_empty(const kvx_op_list *l) {
    return l->head.next == &l->head;
}

void kvx_op_list_push(kvx_op_list *l, kvx_op *op) {
    op->prev = l->head.prev;
    op->next = &l->head;
    l->head.prev->next = op;
    l->head.prev = op;
}

void kvx_op_unlink(kvx_op *op) {
    op->prev->next = op->next;
    op->next->prev = op->prev;
    op->prev = op->next = op;
}

/* ---- host identity ---------------------------------------------------------- */

static uint64_t fnv1a(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
    return h;
}

static uint64_t host_id(void) {
    char buf[64] = {0};
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    size_t n = 0;
    if (f) {
        n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
    }
    if (n == 0) {
        gethostname(buf, sizeof buf - 1);
        n = strlen(buf);
    }
    return fnv1a(buf, n);
}

static uint64_t pid_namespace(void) {
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

/* ---- init / free -------------------------------------------------------------- */

/* Transports lists made only of shared-memory transports cannot give UCX
 * peer-failure handling (UCX 1.13): skip the doomed first attempt. */
static bool shm_only(const char *tls) {
    if (!tls || !*tls)
        return false;
    static const char *shm[] = {"shm", "sm", "posix", "sysv", "cma", "knem", "xpmem", "self"};
    const char *p = tls;
    while (*p) {
        size_t n = strcspn(p, ",");
        const char *w = p[0] == '^' ? NULL : p;
        bool found = false;
        for (size_t i = 0; w && i < sizeof shm / sizeof *shm; i++)
            if (strlen(shm[i]) == n && strncmp(w, shm[i], n) == 0)
                found = true;
        if (!found)
            return false;
        p += n;
        if (*p == ',')
            p++;
    }
    return true;
}

static pd_status make_addr_blob(pd_kvx_agent *a, pd_err *err) {
    ucp_address_t *addr;
    size_t len;
    ucs_status_t s = ucp_worker_get_address(a->worker, &addr, &len);
    if (s != UCS_OK)
        return pd_err_set(err, PD_ERR_IO, "kvx %s: ucp_worker_get_address: %s", a->name,
                          ucs_status_string(s));
    kvx_addr_hdr h = {.magic = KVX_ADDR_MAGIC,
                      .version = KVX_BLOB_VERSION,
                      .hdr_len = sizeof h,
                      .pid = (uint32_t)getpid(),
                      .ucx_len = (uint32_t)len,
                      .host_id = host_id(),
                      .pidns = pid_namespace()};
    a->host_id_hash = h.host_id;
    a->pidns = h.pidns;
    a->addr_blob_len = sizeof h + len;
    a->addr_blob = pd_xmalloc(a->addr_blob_len);
    memcpy(a->addr_blob, &h, sizeof h);
    memcpy((uint8_t *)a->addr_blob + sizeof h, addr, len);
    ucp_worker_release_address(a->worker, addr);
    return PD_OK;
}

static pd_status epoll_add(int epfd, int fd, void *ptr) {
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = ptr};
    return epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev) == 0 ? PD_OK : PD_ERR_IO;
}

pd_status pd_kvx_agent_init(const pd_kvx_config *cfg, pd_kvx_agent **a_p, pd_err *err) {
    if (!cfg || !a_p)
        return pd_err_set(err, PD_ERR_INVALID, "kvx agent: no config");
    pd_kvx_agent *a = pd_xcalloc(1, sizeof *a);
    snprintf(a->name, sizeof a->name, "%s", cfg->name ? cfg->name : "kvx");
    a->on_peer_failed = cfg->on_peer_failed;
    a->user = cfg->user;
    a->ucp_efd = a->epfd = a->kick_fd = -1;
    kvx_op_list_init(&a->done);
    kvx_op_list_init(&a->orphans);
    a->peer_mode_unsupported =
        cfg->no_ucx_peer_failure || shm_only(cfg->transports ? cfg->transports : getenv("UCX_TLS"));

    pd_status st;
    ucp_config_t *ucfg = NULL;
    ucs_status_t s = ucp_config_read(NULL, NULL, &ucfg);
    if (s != UCS_OK) {
        st = pd_err_set(err, PD_ERR_IO, "kvx %s: ucp_config_read: %s", a->name,
                        ucs_status_string(s));
        goto undo_alloc;
    }
    if (cfg->transports && (s = ucp_config_modify(ucfg, "TLS", cfg->transports)) != UCS_OK) {
        st = pd_err_set(err, PD_ERR_INVALID, "kvx %s: transports \"%s\": %s", a->name,
                        cfg->transports, ucs_status_string(s));
        goto undo_config;
    }
    if (cfg->net_devices &&
        (s = ucp_config_modify(ucfg, "NET_DEVICES", cfg->net_devices)) != UCS_OK) {
        st = pd_err_set(err, PD_ERR_INVALID, "kvx %s: net devices \"%s\": %s", a->name,
                        cfg->net_devices, ucs_status_string(s));
        goto undo_config;
    }
    ucp_params_t params = {
        .field_mask =
            UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME,
        .features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
        .mt_workers_shared = 0,
        .name = a->name,
    };
    s = ucp_init(&params, ucfg, &a->ctx);
    if (s != UCS_OK) {
        st = pd_err_set(
            err,
            s == UCS_ERR_NO_DEVICE || s == UCS_ERR_UNSUPPORTED ? PD_ERR_UNSUPPORTED : PD_ERR_IO,
            "kvx %s: ucp_init (transports %s): %s (`ucx_info -d` lists this host's)", a->name,
            cfg->transports ? cfg->transports : "default", ucs_status_string(s));
        goto undo_config;
    }
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    s = ucp_worker_create(a->ctx, &wp, &a->worker);
    if (s != UCS_OK) {
        st = pd_err_set(err, PD_ERR_IO, "kvx %s: ucp_worker_create: %s", a->name,
                        ucs_status_string(s));
        goto undo_context;
    }
    s = ucp_worker_get_efd(a->worker, &a->ucp_efd);
    if (s != UCS_OK) {
        st = pd_err_set(err, PD_ERR_IO, "kvx %s: ucp_worker_get_efd: %s", a->name,
                        ucs_status_string(s));
        goto undo_worker;
    }
    a->epfd = epoll_create1(EPOLL_CLOEXEC);
    a->kick_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (a->epfd < 0 || a->kick_fd < 0 || epoll_add(a->epfd, a->ucp_efd, NULL) != PD_OK ||
        epoll_add(a->epfd, a->kick_fd, NULL) != PD_OK) {
        st = pd_err_set(err, PD_ERR_IO, "kvx %s: event fd set-up: %s", a->name, strerror(errno));
        goto undo_fds;
    }
    if ((st = make_addr_blob(a, err)) != PD_OK)
        goto undo_fds;
    ucp_config_release(ucfg);
    *a_p = a;
    return PD_OK;

undo_fds:
    if (a->kick_fd >= 0)
        close(a->kick_fd);
    if (a->epfd >= 0)
        close(a->epfd);
undo_worker:
    ucp_worker_destroy(a->worker);
undo_context:
    ucp_cleanup(a->ctx);
undo_config:
    ucp_config_release(ucfg);
undo_alloc:
    free(a);
    return st;
}

static void free_op_list(kvx_op_list *l) {
    while (!kvx_op_list_empty(l)) {
        kvx_op *op = l->head.next;
        kvx_op_unlink(op);
        free(op->header);
        free(op);
    }
}

static void deliver_done(pd_kvx_agent *a);

void pd_kvx_agent_free(pd_kvx_agent **a_p) {
    if (!a_p || !*a_p)
        return;
    pd_kvx_agent *a = *a_p;
    PD_ASSERT(!a->in_progress);
    if (a->pools)
        PD_LOGW(KVX_LOG, "%s: agent freed with pools still registered", a->name);
    /* Fail what is outstanding (callbacks run here), release the
     * endpoints, give UCX a bounded moment to finish, then tear down. */
    kvx_peers_shutdown(a);
    deliver_done(a);
    kvx_am_shutdown(a);
    ucp_worker_destroy(a->worker);
    kvx_peers_free(a);
    kvx_am_free(a);
    /* UCX has dropped every request now: the records it still held go. */
    free_op_list(&a->orphans);
    free_op_list(&a->done);
    while (a->pools) {
        pd_kvx_pool *p = a->pools;
        pd_kvx_pool_free(&p);
    }
    ucp_cleanup(a->ctx);
    close(a->kick_fd);
    close(a->epfd);
    free(a->addr_blob);
    free(a);
    *a_p = NULL;
}

void pd_kvx_agent_worker_address(const pd_kvx_agent *a, const void **bytes_p, size_t *len_p) {
    *bytes_p = a->addr_blob;
    *len_p = a->addr_blob_len;
}

int pd_kvx_agent_event_fd(const pd_kvx_agent *a) {
    return a->epfd;
}

void kvx_agent_kick(pd_kvx_agent *a) {
    if (a->in_progress) {
        a->rerun = true; /* progress answers "call again" */
        return;
    }
    if (a->kicked)
        return;
    uint64_t one = 1;
    if (write(a->kick_fd, &one, sizeof one) == (ssize_t)sizeof one)
        a->kicked = true;
}

/* Same-host peers whose process exited: their pidfd is readable. */
static void poll_pidfds(pd_kvx_agent *a) {
    struct epoll_event ev[16];
    int n = epoll_wait(a->epfd, ev, 16, 0);
    for (int i = 0; i < n; i++) {
        pd_kvx_peer *p = ev[i].data.ptr;
        if (!p)
            continue; /* the worker's fd or the kick fd */
        epoll_ctl(a->epfd, EPOLL_CTL_DEL, p->pidfd, NULL);
        close(p->pidfd);
        p->pidfd = -1;
        char why[96];
        snprintf(why, sizeof why, "peer process %d exited", (int)p->pid);
        kvx_peer_mark_failed(p, PD_ERR_IO, why);
    }
}

/* Runs the user callbacks of finished operations: those queued when the
 * call began; later ones wait for the next call (progress says "more"). */
static void deliver_done(pd_kvx_agent *a) {
    kvx_op_list batch;
    kvx_op_list_init(&batch);
    if (kvx_op_list_empty(&a->done))
        return;
    batch.head.next = a->done.head.next;
    batch.head.prev = a->done.head.prev;
    batch.head.next->prev = &batch.head;
    batch.head.prev->next = &batch.head;
    kvx_op_list_init(&a->done);
    while (!kvx_op_list_empty(&batch)) {
        kvx_op *op = batch.head.next;
        kvx_op_unlink(op);
        op->cb(op->user, op->tag, op->st);
        free(op->header);
        free(op);
    }
}

bool pd_kvx_agent_progress(pd_kvx_agent *a) {
    PD_ASSERT(!a->in_progress);
    a->in_progress = true;
    if (a->kicked) {
        uint64_t v;
        if (read(a->kick_fd, &v, sizeof v) < 0 && errno != EAGAIN)
            PD_LOGW(KVX_LOG, "%s: eventfd read: %s", a->name, strerror(errno));
        a->kicked = false;
    }
    while (ucp_worker_progress(a->worker) != 0) {
    }
    poll_pidfds(a);
    a->rerun = false; /* what is marked from here on needs another round */
    /* Completions first, so that on_peer_failed comes after every callback
     * of its peer's operations; then failures and closes; then what those
     * completed. */
    deliver_done(a);
    kvx_peers_progress(a);
    deliver_done(a);
    a->in_progress = false;
    if (a->rerun || !kvx_op_list_empty(&a->done))
        return true;
    ucs_status_t s = ucp_worker_arm(a->worker);
    if (s == UCS_ERR_BUSY)
        return true;
    if (s != UCS_OK)
        PD_LOGW(KVX_LOG, "%s: ucp_worker_arm: %s", a->name, ucs_status_string(s));
    return false;
}

/* ---- pools ------------------------------------------------------------------ */

/* Maps (and with UCP_MEM_MAP_ALLOCATE, allocates) a pool and packs its key. */
static pd_status pool_map(pd_kvx_agent *a, void *base, size_t bytes, unsigned flags,
                          pd_kvx_pool **pool_p, pd_err *err) {
    ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                                             UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                                             UCP_MEM_MAP_PARAM_FIELD_FLAGS,
                               .address = base,
                               .length = bytes,
                               .flags = flags};
    ucp_mem_h memh;
    ucs_status_t s = ucp_mem_map(a->ctx, &mp, &memh);
    if (s != UCS_OK)
        return pd_err_set(err, (flags & UCP_MEM_MAP_ALLOCATE) ? PD_ERR_NOMEM : PD_ERR_IO,
                          "kvx %s: ucp_mem_map%s of %zu bytes: %s", a->name,
                          (flags & UCP_MEM_MAP_ALLOCATE) ? " (allocate)" : "", bytes,
                          ucs_status_string(s));
    ucp_mem_attr_t attr = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH};
    if ((s = ucp_mem_query(memh, &attr)) != UCS_OK || attr.length < bytes) {
        ucp_mem_unmap(a->ctx, memh);
        return pd_err_set(err, PD_ERR_IO, "kvx %s: ucp_mem_query: %s", a->name,
                          s != UCS_OK ? ucs_status_string(s) : "mapping shorter than asked");
    }
    void *rkey;
    size_t rkey_len;
    s = ucp_rkey_pack(a->ctx, memh, &rkey, &rkey_len);
    if (s != UCS_OK) {
        ucp_mem_unmap(a->ctx, memh);
        return pd_err_set(err, PD_ERR_IO, "kvx %s: ucp_rkey_pack: %s", a->name,
                          ucs_status_string(s));
    }
    pd_kvx_pool *p = pd_xcalloc(1, sizeof *p);
    p->agent = a;
    p->base = attr.address;
    p->bytes = bytes;
    p->memh = memh;
    kvx_rkey_hdr h = {.magic = KVX_RKEY_MAGIC,
                      .version = KVX_BLOB_VERSION,
                      .hdr_len = sizeof h,
                      .base = (uint64_t)(uintptr_t)p->base,
                      .bytes = bytes,
                      .rkey_len = (uint32_t)rkey_len};
    p->blob_len = sizeof h + rkey_len;
    p->blob = pd_xmalloc(p->blob_len);
    memcpy(p->blob, &h, sizeof h);
    memcpy((uint8_t *)p->blob + sizeof h, rkey, rkey_len);
    ucp_rkey_buffer_release(rkey);
    p->next = a->pools;
    a->pools = p;
    *pool_p = p;
    return PD_OK;
}

pd_status pd_kvx_register_pool(pd_kvx_agent *a, void *base, size_t bytes, pd_kvx_pool **pool_p,
                               pd_err *err) {
    if (!base || bytes == 0)
        return pd_err_set(err, PD_ERR_INVALID, "kvx %s: pool needs a base and a size", a->name);
    uintptr_t lo = (uintptr_t)base, hi = lo + bytes;
    if (hi < lo)
        return pd_err_set(err, PD_ERR_INVALID, "kvx %s: pool wraps around", a->name);
    for (pd_kvx_pool *p = a->pools; p; p = p->next)
        if (lo < (uintptr_t)p->base + p->bytes && (uintptr_t)p->base < hi)
            return pd_err_set(err, PD_ERR_INVALID,
                              "kvx %s: pool [%p, +%zu) overlaps a registered pool [%p, +%zu)",
                              a->name, base, bytes, (void *)p->base, p->bytes);
    return pool_map(a, base, bytes, 0, pool_p, err);
}

pd_status pd_kvx_alloc_pool(pd_kvx_agent *a, size_t bytes, pd_kvx_pool **pool_p, pd_err *err) {
    if (bytes == 0)
        return pd_err_set(err, PD_ERR_INVALID, "kvx %s: pool of 0 bytes", a->name);
    return pool_map(a, NULL, bytes, UCP_MEM_MAP_ALLOCATE, pool_p, err);
}

void *pd_kvx_pool_base(const pd_kvx_pool *pool) {
    return pool->base;
}

void pd_kvx_pool_rkey(const pd_kvx_pool *pool, const void **bytes_p, size_t *len_p) {
    *bytes_p = pool->blob;
    *len_p = pool->blob_len;
}

void pd_kvx_pool_free(pd_kvx_pool **pool_p) {
    if (!pool_p || !*pool_p)
        return;
    pd_kvx_pool *p = *pool_p;
    pd_kvx_agent *a = p->agent;
    pd_kvx_pool **pp = &a->pools;
    while (*pp != p)
        pp = &(*pp)->next;
    *pp = p->next;
    if (a->am_pool == p)
        a->am_pool = NULL;
    ucp_mem_unmap(a->ctx, p->memh);
    free(p->blob);
    free(p);
    *pool_p = NULL;
}

const pd_kvx_pool *kvx_agent_find_pool(const pd_kvx_agent *a, const void *ptr, size_t bytes) {
    uintptr_t lo = (uintptr_t)ptr;
    for (const pd_kvx_pool *p = a->pools; p; p = p->next)
        if (lo >= (uintptr_t)p->base && bytes <= p->bytes &&
            lo - (uintptr_t)p->base <= p->bytes - bytes)
            return p;
    return NULL;
}

/* ---- blob parsing (used by peer.c) ------------------------------------------ */

pd_status kvx_parse_addr(const void *blob, size_t len, const void **ucx_p, uint32_t *pid_p,
                         uint64_t *host_p, uint64_t *pidns_p, pd_err *err) {
    kvx_addr_hdr h;
    if (!blob || len < sizeof h)
        return pd_err_set(err, PD_ERR_FORMAT, "kvx: worker address blob of %zu bytes is too short",
                          len);
    memcpy(&h, blob, sizeof h);
    if (h.magic != KVX_ADDR_MAGIC || h.version != KVX_BLOB_VERSION || h.hdr_len != sizeof h)
        return pd_err_set(err, PD_ERR_FORMAT,
                          "kvx: not a worker address blob (magic %08x version %u header %u)",
                          h.magic, h.version, h.hdr_len);
    if (h.ucx_len == 0 || h.ucx_len != len - sizeof h)
        return pd_err_set(err, PD_ERR_FORMAT, "kvx: worker address blob says %u UCX bytes, has %zu",
                          h.ucx_len, len - sizeof h);
    *ucx_p = (const uint8_t *)blob + sizeof h;
    *pid_p = h.pid;
    *host_p = h.host_id;
    *pidns_p = h.pidns;
    return PD_OK;
}

pd_status kvx_parse_rkey(const void *blob, size_t len, const void **rkey_p, uint64_t *base_p,
                         uint64_t *bytes_p, pd_err *err) {
    kvx_rkey_hdr h;
    if (!blob || len < sizeof h)
        return pd_err_set(err, PD_ERR_FORMAT, "kvx: rkey blob of %zu bytes is too short", len);
    memcpy(&h, blob, sizeof h);
    if (h.magic != KVX_RKEY_MAGIC || h.version != KVX_BLOB_VERSION || h.hdr_len != sizeof h)
        return pd_err_set(err, PD_ERR_FORMAT,
                          "kvx: not an rkey blob (magic %08x version %u header %u)", h.magic,
                          h.version, h.hdr_len);
    if (h.rkey_len == 0 || h.rkey_len != len - sizeof h || h.bytes == 0 ||
        h.base + h.bytes < h.base)
        return pd_err_set(err, PD_ERR_FORMAT,
                          "kvx: rkey blob inconsistent (key %u of %zu bytes, pool %llu bytes)",
                          h.rkey_len, len - sizeof h, (unsigned long long)h.bytes);
    *rkey_p = (const uint8_t *)blob + sizeof h;
    *base_p = h.base;
    *bytes_p = h.bytes;
    return PD_OK;
}
