/* kvtransfer/ internals shared by the .c files of this directory; not for
 * other modules (they include pd_kvtransfer.h only). */
#ifndef PD_KVX_IMPL_H
#define PD_KVX_IMPL_H

#include "pd_kvtransfer.h"

#include <sys/types.h>
#include <ucp/api/ucp.h>

#define KVX_LOG "kvx"

/* Maps a UCX status to ours: every transport-level failure is PD_ERR_IO. */
static inline pd_status kvx_status(ucs_status_t s) {
    return s == UCS_OK ? PD_OK : PD_ERR_IO;
}

/* ---- operations ---------------------------------------------------------
 * One user-visible operation (a put batch, a flush, an AM write batch). It
 * holds `pending` UCX requests; their callbacks only count down. When the
 * last one is done the op moves to the agent's `done` queue, and
 * pd_kvx_agent_progress calls the user's callback: UCX may complete a
 * request inside ucp_put_nbx itself (UCP_OP_ATTR_FLAG_NO_IMM_CMPL calls the
 * callback before returning), and the user must never be re-entered there.
 *
 * An op whose peer failed is "orphaned": the user's callback runs at once
 * (PD_ERR_IO) and the op waits in `orphans` for UCX to finish with its
 * requests — with UCP_ERR_HANDLING_MODE_NONE a dead peer's requests may
 * never complete; ucp_worker_destroy reclaims them and the agent frees the
 * op records after it. */
typedef struct kvx_op kvx_op;
struct kvx_op {
    kvx_op *prev, *next; /* in peer->ops, agent->done or agent->orphans */
    pd_kvx_agent *agent;
    pd_kvx_peer *peer; /* NULL once orphaned */
    pd_kvx_done_cb cb;
    void *user;
    uint64_t tag;
    uint32_t pending; /* UCX requests not yet completed */
    uint32_t posted;  /* UCX requests posted */
    bool issuing;     /* its requests are being posted: not finished yet */
    pd_status st;     /* first error */
    bool orphan;      /* user told; only waiting for UCX */
    void *header;     /* AM path: headers owned by the op (freed with it) */
};

typedef struct {
    kvx_op head; /* sentinel: head.next is the first op */
} kvx_op_list;

void kvx_op_list_init(kvx_op_list *l);
bool kvx_op_list_empty(const kvx_op_list *l);
void kvx_op_list_push(kvx_op_list *l, kvx_op *op);
void kvx_op_unlink(kvx_op *op);

/* ---- agent, pools, peers -------------------------------------------------- */

struct pd_kvx_pool {
    pd_kvx_agent *agent;
    pd_kvx_pool *next; /* agent->pools */
    uint8_t *base;
    size_t bytes;
    ucp_mem_h memh;
    void *blob; /* framed rkey blob */
    size_t blob_len;
};

typedef enum { KVX_PEER_UP = 0, KVX_PEER_FAILED, KVX_PEER_CLOSING } kvx_peer_state;

struct pd_kvx_peer {
    pd_kvx_agent *agent;
    pd_kvx_peer *prev, *next; /* agent->peers */
    ucp_ep_h ep;
    ucp_err_handling_mode_t err_mode;
    ucp_rkey_h rkey;
    uint64_t remote_base, remote_bytes;
    pid_t pid; /* same-host peer's pid, 0 if unknown */
    int pidfd; /* -1 when not watched */
    kvx_peer_state state;
    bool user_closed;   /* pd_kvx_peer_close called; free once quiet */
    bool fail_pending;  /* failure noticed, not yet processed in progress */
    bool fail_reported; /* on_peer_failed ran */
    void *close_req;    /* ucp_ep_close_nbx request in flight */
    bool ep_gone;       /* ep closed (or abandoned) */
    pd_status fail_st;
    char fail_reason[160];
    kvx_op_list ops; /* operations the user still waits for */
    void *user;
};

struct pd_kvx_agent {
    char name[64];
    ucp_context_h ctx;
    ucp_worker_h worker;
    int ucp_efd;
    int epfd;    /* what the service watches: ucp_efd, kick_fd, peers' pidfds */
    int kick_fd; /* eventfd: "call progress" (deferred callbacks queued) */
    bool kicked;
    bool in_progress;
    bool rerun; /* work appeared during progress (a callback failed or closed a peer) */
    bool peer_mode_unsupported; /* PEER err mode failed once: use NONE */
    pd_kvx_peer_failed_cb on_peer_failed;
    void *user;
    void *addr_blob;
    size_t addr_blob_len;
    uint64_t host_id_hash; /* hash of the boot id */
    uint64_t pidns;        /* pid namespace inode */
    pd_kvx_pool *pools;
    pd_kvx_peer *peers;
    kvx_op_list done;    /* completed, user callback due */
    kvx_op_list orphans; /* user told, UCX requests outstanding */
    /* AM receive side (am.c) */
    pd_kvx_reservations *am_table;
    pd_kvx_pool *am_pool;
    struct kvx_am_recv *am_recvs; /* rendezvous receives in flight */
};

/* agent.c */
void kvx_agent_kick(pd_kvx_agent *a);
const pd_kvx_pool *kvx_agent_find_pool(const pd_kvx_agent *a, const void *p, size_t bytes);
pd_status kvx_parse_addr(const void *blob, size_t len, const void **ucx_p, uint32_t *pid_p,
                         uint64_t *host_p, uint64_t *pidns_p, pd_err *err);
pd_status kvx_parse_rkey(const void *blob, size_t len, const void **rkey_p, uint64_t *base_p,
                         uint64_t *bytes_p, pd_err *err);

/* peer.c: an op's UCX request finished (any status). */
void kvx_op_req_done(void *request, ucs_status_t status, void *user_data);
kvx_op *kvx_op_new(pd_kvx_peer *peer, uint64_t tag, pd_kvx_done_cb cb, void *user);
/* The op's posting is over: queue it as done if nothing is pending; if no
 * request was posted at all and status is an error, frees it and returns
 * false (the caller returns the error, cb never fires). */
bool kvx_op_posted(kvx_op *op);
void kvx_peer_mark_failed(pd_kvx_peer *p, pd_status st, const char *reason);
/* progress-time work for peers: failures, finished closes. */
void kvx_peers_progress(pd_kvx_agent *a);
/* agent_free: fail and close every peer, before ucp_worker_destroy ... */
void kvx_peers_shutdown(pd_kvx_agent *a);
/* ... and free their records after it (UCX may call their error handler
 * while destroying the worker). */
void kvx_peers_free(pd_kvx_agent *a);

pd_status kvx_peer_usable(const pd_kvx_peer *p, pd_err *err);
void kvx_req_param(const pd_kvx_agent *a, kvx_op *op, const void *local, size_t bytes,
                   ucp_request_param_t *prm);

/* am.c: before ucp_worker_destroy, receives in flight stop touching the
 * table; after it, their records are freed. */
void kvx_am_shutdown(pd_kvx_agent *a);
void kvx_am_free(pd_kvx_agent *a);

/* reservations.c — hooks for the AM receive path */
typedef struct kvx_resv kvx_resv;
kvx_resv *kvx_resv_find(pd_kvx_reservations *t, const char *request_id, uint64_t resv_id);
/* A validated write into r started (inflight) / finished having landed
 * `bytes` (0 if it failed). Finishing may complete a pending claim or hand
 * the blocks back. */
void kvx_resv_write_begin(kvx_resv *r);
void kvx_resv_write_end(pd_kvx_reservations *t, kvx_resv *r, uint64_t bytes);
/* The AM claim: judged now, or held until in-flight writes land. */
void kvx_resv_am_claim(pd_kvx_reservations *t, const char *request_id, uint64_t resv_id,
                       uint64_t writer, uint64_t bytes, double now_s);
/* Report through on_am_event. */
void kvx_resv_report(pd_kvx_reservations *t, const char *request_id, uint64_t resv_id,
                     pd_kvx_verdict v, const char *detail);

#endif
