/* Peers: endpoints to other replicas' workers, their pool's remote key,
 * liveness, and the one-sided writes (put, batched put, flush).
 *
 * Liveness. With UCP_ERR_HANDLING_MODE_PEER, UCX reports a broken endpoint
 * through ep_err_cb and completes its outstanding requests with an error.
 * Shared-memory transports cannot give that mode in UCX 1.13, so such
 * endpoints use MODE_NONE, and a same-host peer's process is watched with
 * a pidfd (agent.c polls it). Either way a failure is only recorded where
 * it is noticed; kvx_peers_progress does the work — fails the user's
 * operations, tells the service, releases the endpoint — outside any UCX
 * callback. */
#include "kvx_impl.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/syscall.h>
#include <unistd.h>

/* ---- operations ------------------------------------------------------------ */

kvx_op *kvx_op_new(pd_kvx_peer *peer, uint64_t tag, pd_kvx_done_cb cb, void *user) {
    kvx_op *op = pd_xcalloc(1, sizeof *op);
    op->agent = peer->agent;
    op->peer = peer;
    op->cb = cb;
    op->user = user;
    op->tag = tag;
    op->issuing = true;
    kvx_op_list_push(&peer->ops, op);
    return op;
}

static void op_free(kvx_op *op) {
    free(op->header);
    free(op);
}

/* All of the op's requests are done: queue the user's callback, or, for an
 * orphan whose user was already told, just free it. */
static void op_finish(kvx_op *op) {
    kvx_op_unlink(op);
    if (op->orphan) {
        op_free(op);
        return;
    }
    op->peer = NULL;
    kvx_op_list_push(&op->agent->done, op);
    kvx_agent_kick(op->agent);
}

void kvx_op_req_done(void *request, ucs_status_t status, void *user_data) {
    kvx_op *op = user_data;
    ucp_request_free(request);
    if (status != UCS_OK && op->st == PD_OK) {
        op->st = PD_ERR_IO;
        if (!op->orphan)
            PD_LOGD(KVX_LOG, "%s: operation %llu: %s", op->agent->name, (unsigned long long)op->tag,
                    ucs_status_string(status));
    }
    PD_ASSERT(op->pending > 0);
    if (--op->pending == 0 && !op->issuing)
        op_finish(op);
}

bool kvx_op_posted(kvx_op *op) {
    op->issuing = false;
    if (op->pending > 0)
        return true;
    if (op->posted == 0 && op->st != PD_OK) {
        kvx_op_unlink(op);
        op_free(op);
        return false;
    }
    op_finish(op);
    return true;
}

/* ---- failure -------------------------------------------------------------- */

void kvx_peer_mark_failed(pd_kvx_peer *p, pd_status st, const char *reason) {
    if (p->state == KVX_PEER_FAILED)
        return; /* the first reason stands */
    p->state = KVX_PEER_FAILED;
    p->fail_pending = true;
    p->fail_st = st;
    snprintf(p->fail_reason, sizeof p->fail_reason, "%s", reason);
    if (!p->user_closed)
        PD_LOGW(KVX_LOG, "%s: peer failed: %s", p->agent->name, reason);
    kvx_agent_kick(p->agent);
}

static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status) {
    (void)ep; /* p->ep */
    pd_kvx_peer *p = arg;
    char why[128];
    snprintf(why, sizeof why, "UCX endpoint error: %s", ucs_status_string(status));
    kvx_peer_mark_failed(p, PD_ERR_IO, why);
}

/* Starts closing the endpoint. FORCE needs MODE_PEER (UCX refuses it
 * otherwise); without it the close flushes first, which for a dead peer
 * never finishes — the request then waits for ucp_worker_destroy. */
static void peer_close_ep(pd_kvx_peer *p, bool force) {
    if (p->ep_gone || p->close_req)
        return;
    ucp_request_param_t prm = {0};
    if (force && p->err_mode == UCP_ERR_HANDLING_MODE_PEER) {
        prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        prm.flags = UCP_EP_CLOSE_FLAG_FORCE;
    }
    void *r = ucp_ep_close_nbx(p->ep, &prm);
    if (r == NULL || UCS_PTR_IS_ERR(r))
        p->ep_gone = true;
    else
        p->close_req = r;
}

static void peer_orphan_ops(pd_kvx_peer *p) {
    pd_kvx_agent *a = p->agent;
    while (!kvx_op_list_empty(&p->ops)) {
        kvx_op *op = p->ops.head.next;
        kvx_op_unlink(op);
        op->peer = NULL;
        op->orphan = true;
        op->st = PD_ERR_IO;
        kvx_op_list_push(&a->orphans, op);
        op->cb(op->user, op->tag, PD_ERR_IO);
    }
}

static void peer_unwatch(pd_kvx_peer *p) {
    if (p->pidfd < 0)
        return;
    epoll_ctl(p->agent->epfd, EPOLL_CTL_DEL, p->pidfd, NULL);
    close(p->pidfd);
    p->pidfd = -1;
}

static void peer_free(pd_kvx_peer *p) {
    pd_kvx_agent *a = p->agent;
    if (p->prev)
        p->prev->next = p->next;
    else
        a->peers = p->next;
    if (p->next)
        p->next->prev = p->prev;
    peer_unwatch(p);
    free(p);
}

void kvx_peers_progress(pd_kvx_agent *a) {
    pd_kvx_peer *next;
    for (pd_kvx_peer *p = a->peers; p; p = next) {
        next = p->next;
        if (p->fail_pending) {
            p->fail_pending = false;
            peer_unwatch(p);
            peer_orphan_ops(p);
            if (!p->fail_reported && !p->user_closed && a->on_peer_failed) {
                p->fail_reported = true;
                a->on_peer_failed(a->user, p, p->fail_st, p->fail_reason);
            }
            peer_close_ep(p, true);
        }
        if (p->close_req && ucp_request_check_status(p->close_req) != UCS_INPROGRESS) {
            ucp_request_free(p->close_req);
            p->close_req = NULL;
            p->ep_gone = true;
        }
        if (p->user_closed && p->ep_gone && kvx_op_list_empty(&p->ops)) {
            if (p->rkey)
                ucp_rkey_destroy(p->rkey);
            peer_free(p);
        }
    }
}

void kvx_peers_shutdown(pd_kvx_agent *a) {
    for (pd_kvx_peer *p = a->peers; p; p = p->next) {
        p->user_closed = true;
        kvx_peer_mark_failed(p, PD_ERR_IO, "agent shutting down");
    }
    kvx_peers_progress(a);
    /* A bounded wait for the closes (live MODE_NONE peers flush first). */
    double until = pd_now_s() + 1.0;
    while (a->peers && pd_now_s() < until) {
        ucp_worker_progress(a->worker);
        kvx_peers_progress(a);
    }
    for (pd_kvx_peer *p = a->peers; p; p = p->next) {
        if (p->close_req) {
            ucp_request_free(p->close_req); /* UCX finishes or drops it with the worker */
            p->close_req = NULL;
        }
        if (p->rkey) {
            ucp_rkey_destroy(p->rkey);
            p->rkey = NULL;
        }
    }
}

void kvx_peers_free(pd_kvx_agent *a) {
    while (a->peers)
        peer_free(a->peers);
}

/* ---- connect ------------------------------------------------------------- */

static void peer_watch_process(pd_kvx_peer *p, uint32_t pid) {
    pd_kvx_agent *a = p->agent;
    int fd = (int)syscall(SYS_pidfd_open, (pid_t)pid, 0);
    if (fd < 0) {
        if (errno == ESRCH) {
            char why[96];
            snprintf(why, sizeof why, "peer process %u is not running", pid);
            kvx_peer_mark_failed(p, PD_ERR_IO, why);
        } else {
            PD_LOGD(KVX_LOG, "%s: pidfd_open(%u): %s; peer liveness left to the service", a->name,
                    pid, strerror(errno));
        }
        return;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = p};
    if (epoll_ctl(a->epfd, EPOLL_CTL_ADD, fd, &ev) != 0) {
        close(fd);
        return;
    }
    p->pid = (pid_t)pid;
    p->pidfd = fd;
}

pd_status pd_kvx_peer_connect(pd_kvx_agent *a, const void *addr_blob, size_t len, void *user,
                              pd_kvx_peer **peer_p, pd_err *err) {
    const void *ucx;
    uint32_t pid;
    uint64_t host, pidns;
    pd_status st = kvx_parse_addr(addr_blob, len, &ucx, &pid, &host, &pidns, err);
    if (st != PD_OK)
        return st;
    pd_kvx_peer *p = pd_xcalloc(1, sizeof *p);
    p->agent = a;
    p->pidfd = -1;
    p->user = user;
    kvx_op_list_init(&p->ops);
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = ucx,
        .err_handler = {.cb = ep_err_cb, .arg = p},
    };
    ucs_status_t s = UCS_ERR_UNREACHABLE;
    if (!a->peer_mode_unsupported) {
        ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
        s = ucp_ep_create(a->worker, &ep, &p->ep);
        if (s == UCS_ERR_UNREACHABLE) {
            PD_LOGI(KVX_LOG,
                    "%s: no transport to this peer offers UCX peer-failure handling; "
                    "using MODE_NONE (same-host liveness by pidfd)",
                    a->name);
            a->peer_mode_unsupported = true;
        }
    }
    if (a->peer_mode_unsupported) {
        ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
        s = ucp_ep_create(a->worker, &ep, &p->ep);
    }
    if (s != UCS_OK) {
        free(p);
        return pd_err_set(err, PD_ERR_IO, "kvx %s: ucp_ep_create: %s", a->name,
                          ucs_status_string(s));
    }
    p->err_mode = ep.err_mode;
    p->next = a->peers;
    if (a->peers)
        a->peers->prev = p;
    a->peers = p;
    if (host == a->host_id_hash && pidns == a->pidns && pid != 0 && (pid_t)pid != getpid())
        peer_watch_process(p, pid);
    *peer_p = p;
    return PD_OK;
}

pd_status pd_kvx_peer_add_rkey(pd_kvx_peer *p, const void *blob, size_t len, pd_err *err) {
    const void *rkey;
    uint64_t base, bytes;
    pd_status st = kvx_parse_rkey(blob, len, &rkey, &base, &bytes, err);
    if (st != PD_OK)
        return st;
    if (p->rkey)
        return pd_err_set(err, PD_ERR_INVALID, "kvx %s: peer already has a remote key",
                          p->agent->name);
    if (p->state != KVX_PEER_UP)
        return pd_err_set(err, PD_ERR_INVALID, "kvx %s: peer %s%s", p->agent->name,
                          p->state == KVX_PEER_FAILED ? "failed: " : "is closing",
                          p->state == KVX_PEER_FAILED ? p->fail_reason : "");
    ucs_status_t s = ucp_ep_rkey_unpack(p->ep, rkey, &p->rkey);
    if (s != UCS_OK) {
        p->rkey = NULL;
        return pd_err_set(err, PD_ERR_IO, "kvx %s: ucp_ep_rkey_unpack: %s", p->agent->name,
                          ucs_status_string(s));
    }
    p->remote_base = base;
    p->remote_bytes = bytes;
    return PD_OK;
}

void *pd_kvx_peer_user(const pd_kvx_peer *p) {
    return p->user;
}

bool pd_kvx_peer_failed(const pd_kvx_peer *p) {
    return p->state == KVX_PEER_FAILED;
}

void pd_kvx_peer_fail(pd_kvx_peer *p, const char *reason) {
    kvx_peer_mark_failed(p, PD_ERR_IO, reason ? reason : "declared failed by the service");
}

void pd_kvx_peer_close(pd_kvx_peer **peer_p) {
    if (!peer_p || !*peer_p)
        return;
    pd_kvx_peer *p = *peer_p;
    *peer_p = NULL;
    p->user_closed = true;
    p->user = NULL;
    if (p->state == KVX_PEER_UP) {
        p->state = KVX_PEER_CLOSING;
        peer_close_ep(p, false); /* graceful: outstanding operations finish first */
    }
    kvx_agent_kick(p->agent);
}

/* ---- writes ---------------------------------------------------------------- */

/* Refuses work on a peer that cannot take it; err says why. */
pd_status kvx_peer_usable(const pd_kvx_peer *p, pd_err *err) {
    if (p->state == KVX_PEER_UP)
        return PD_OK;
    /* "peer failed: <reason>": the reason is a sentence of its own
     * ("peer process 12 exited"), not the end of this one */
    return pd_err_set(err, PD_ERR_IO, "kvx %s: peer %s%s", p->agent->name,
                      p->state == KVX_PEER_FAILED ? "failed: " : "is closing",
                      p->state == KVX_PEER_FAILED ? p->fail_reason : "");
}

/* Request parameters for one piece of an op: completion into op (the
 * user's callback is deferred to progress), and the local pool's memory
 * handle when the buffer lies in one (zero-copy). NO_IMM_CMPL asks for a
 * request even when the operation completes at once — UCX then runs our
 * callback inside the call; some calls (ucp_ep_flush_nbx in 1.13) ignore
 * the flag and return NULL, which the callers treat as done. */
void kvx_req_param(const pd_kvx_agent *a, kvx_op *op, const void *local, size_t bytes,
                   ucp_request_param_t *prm) {
    memset(prm, 0, sizeof *prm);
    prm->op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    prm->cb.send = kvx_op_req_done;
    prm->user_data = op;
    const pd_kvx_pool *pool = local ? kvx_agent_find_pool(a, local, bytes) : NULL;
    if (pool) {
        prm->op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        prm->memh = pool->memh;
    }
}

pd_status pd_kvx_put_batch(pd_kvx_peer *p, const pd_kvx_iov *iov, size_t n, uint64_t tag,
                           pd_kvx_done_cb cb, void *user, pd_err *err) {
    pd_kvx_agent *a = p->agent;
    if (!iov || n == 0 || !cb)
        return pd_err_set(err, PD_ERR_INVALID, "kvx %s: put needs pieces and a callback", a->name);
    pd_status st = kvx_peer_usable(p, err);
    if (st != PD_OK)
        return st;
    if (!p->rkey)
        return pd_err_set(err, PD_ERR_INVALID, "kvx %s: put before the peer's remote key", a->name);
    for (size_t i = 0; i < n; i++) {
        uint64_t off = iov[i].remote_offset, len = iov[i].bytes;
        if (!iov[i].local || len == 0 || off > p->remote_bytes || len > p->remote_bytes - off)
            return pd_err_set(err, PD_ERR_INVALID,
                              "kvx %s: put piece %zu: %llu bytes at remote offset %llu is "
                              "outside the peer's pool of %llu bytes",
                              a->name, i, (unsigned long long)len, (unsigned long long)off,
                              (unsigned long long)p->remote_bytes);
    }
    kvx_op *op = kvx_op_new(p, tag, cb, user);
    for (size_t i = 0; i < n; i++) {
        ucp_request_param_t prm;
        kvx_req_param(a, op, iov[i].local, iov[i].bytes, &prm);
        op->pending++;
        op->posted++;
        void *r = ucp_put_nbx(p->ep, iov[i].local, iov[i].bytes,
                              p->remote_base + iov[i].remote_offset, p->rkey, &prm);
        if (UCS_PTR_IS_ERR(r)) {
            op->pending--;
            op->posted--;
            op->st = PD_ERR_IO;
            pd_err_set(err, PD_ERR_IO, "kvx %s: ucp_put_nbx (piece %zu): %s", a->name, i,
                       ucs_status_string(UCS_PTR_STATUS(r)));
            break;
        }
        if (r == NULL)
            op->pending--; /* done at once, no callback */
    }
    if (!kvx_op_posted(op))
        return PD_ERR_IO;
    kvx_agent_kick(a);
    return PD_OK;
}

pd_status pd_kvx_put(pd_kvx_peer *p, const void *local, size_t bytes, uint64_t remote_offset,
                     uint64_t tag, pd_kvx_done_cb cb, void *user, pd_err *err) {
    pd_kvx_iov one = {.local = local, .remote_offset = remote_offset, .bytes = bytes};
    return pd_kvx_put_batch(p, &one, 1, tag, cb, user, err);
}

pd_status pd_kvx_flush(pd_kvx_peer *p, uint64_t tag, pd_kvx_done_cb cb, void *user, pd_err *err) {
    pd_kvx_agent *a = p->agent;
    if (!cb)
        return pd_err_set(err, PD_ERR_INVALID, "kvx %s: flush needs a callback", a->name);
    pd_status st = kvx_peer_usable(p, err);
    if (st != PD_OK)
        return st;
    kvx_op *op = kvx_op_new(p, tag, cb, user);
    ucp_request_param_t prm;
    kvx_req_param(a, op, NULL, 0, &prm);
    op->pending = op->posted = 1;
    /* UCX 1.13 ignores NO_IMM_CMPL here: NULL means flushed already. */
    void *r = ucp_ep_flush_nbx(p->ep, &prm);
    if (r == NULL)
        op->pending = 0;
    if (UCS_PTR_IS_ERR(r)) {
        op->pending = op->posted = 0;
        op->st = PD_ERR_IO;
        pd_err_set(err, PD_ERR_IO, "kvx %s: ucp_ep_flush_nbx: %s", a->name,
                   ucs_status_string(UCS_PTR_STATUS(r)));
    }
    if (!kvx_op_posted(op))
        return PD_ERR_IO;
    kvx_agent_kick(a);
    return PD_OK;
}
