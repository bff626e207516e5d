/* kvtransfer/ — KV block transfer between replicas over UCX (ucp).
 *
 * Read this header first. It has four parts:
 *   1. the agent: one UCX context + one worker per replica rank, driven by
 *      the service's own event loop (no thread of its own);
 *   2. memory: the KV pool registered once, its remote key packed into a
 *      blob for peers; peers connected by worker address;
 *   3. writes: one-sided puts (ucp_put_nbx) with completion callbacks and a
 *      flush; and receiver-validated writes (ucp_am_send_nbx);
 *   4. reservations: the decode replica's table of (request id, reservation
 *      id) → blocks, which decides whether a write or a "KV complete" claim
 *      is accepted, and when reserved blocks may be reused.
 *
 * Threading: every object of this module belongs to the thread that drives
 * its agent (UCS_THREAD_MODE_SINGLE). Callbacks run on that thread, from
 * pd_kvx_agent_progress() only — never from inside the call that started
 * the operation — so a callback may start new operations.
 *
 * ---------------------------------------------------------------------------
 * THE RESERVATION PROTOCOL
 * ---------------------------------------------------------------------------
 * Actors: D, the decode replica that owns the target KV pool and the
 * pd_kvx_reservations table; P, the prefill replica that writes. Control
 * messages (Reserve, Grant, KvComplete, Fenced, Abort) travel on the
 * ZeroMQ control plane and are not part of this module; the module gives D
 * the state machine that answers them, and gives P the writes and the flush.
 *
 *   1. Reserve. D allocates blocks and calls pd_kvx_resv_create(request id,
 *      writer id, blocks, ttl): state LIVE, deadline = now + ttl. The
 *      reservation id is chosen by D, unique for the life of the table, with
 *      32 random high bits so that ids of a restarted D never repeat. D sends
 *      P the Grant: (request id, reservation id, block ids, lease), where
 *      lease = pd_kvx_lease_s(ttl) = ttl - margin and margin =
 *      pd_kvx_lease_margin_s(ttl) = ttl / 4 (pdserve: ReserveReply.lease_ms,
 *      copied by the gateway into Prefill.lease_ms at once).
 *   2. Write. P writes only the granted blocks (remote offset = block id ×
 *      block bytes) with pd_kvx_put / pd_kvx_put_batch, and stops issuing
 *      writes once its lease, timed from when P received the Grant, runs
 *      out. In real time P received it d (D→gateway→P delivery, queueing
 *      included) after D created the reservation, so P's last write is
 *      issued by deadline - margin + d: before D's deadline when d < margin.
 *   3. Complete. P calls pd_kvx_flush; only when the flush callback reports
 *      PD_OK (every earlier put on that peer is visible in D's memory) does P
 *      send KvComplete(request id, reservation id, writer id). D calls
 *      pd_kvx_resv_complete(): LIVE and in time → COMPLETE, the blocks now
 *      belong to the decode sequence. Unknown, expired, released, already
 *      completed or from the wrong writer → refused with a pd_kvx_verdict and
 *      a reason in err; D answers the refusal and never reads the blocks.
 *   4. Abort / expiry. D releases a LIVE reservation (pd_kvx_resv_release,
 *      on Abort) or finds it past its deadline (pd_kvx_resv_expire): the
 *      state becomes RELEASED / EXPIRED and every later claim is refused.
 *      D tells P (Abort); P stops writing, flushes, and answers Fenced.
 *   5. Reuse. One-sided puts cannot be refused by the target, so the
 *      blocks of a RELEASED or EXPIRED reservation stay quarantined — they
 *      are handed back through the blocks_free callback — only when the
 *      writer is known to have stopped:
 *        - P's Fenced arrives (pd_kvx_resv_fenced): P's flush completed
 *          after P stopped issuing writes;
 *        - any KvComplete from P for it arrives, even a refused one (P sends
 *          it only after its flush completed);
 *        - P is gone (pd_kvx_resv_writer_gone, called when the peer's
 *          endpoint fails, its process exits, or its heartbeats stop): a
 *          dead process issues no writes, and the kernel closes the
 *          connections its writes travelled on. A writer that is declared
 *          gone while still alive (stalled past the heartbeat timeout) is
 *          the one case no fence covers: the supervisor must kill such a
 *          replica before its reservations are handed back.
 *        - the writer's lease has ended for certain: deadline + margin has
 *          passed (cfg.reclaim_after_s = margin; pd_kvx_resv_expire). P
 *          issued its last write by deadline - margin + d, so this holds
 *          when d plus the time a put takes to land (f) is below 2 × margin
 *          (60 s at pdserve's 120 s ttl) — a bound on a *running* writer.
 *          This covers the Grant or the KvComplete lost with a gateway that
 *          died (nothing else would ever end such a reservation) and a
 *          writer whose flush failed. A writer stopped longer than that
 *          (SIGSTOP) and resumed is the stalled-writer case below.
 *      So a late write can only land in blocks no other request can see,
 *      and its data is never used: the only way to make blocks readable is
 *      an accepted KvComplete.
 *      If the Grant was never delivered to P, D calls pd_kvx_resv_fenced
 *      itself.
 *
 * Receiver-validated writes (PD_KVX_RESV_AM reservations, pd_kvx_am_*):
 * each write is an active message carrying (request id, reservation id,
 * writer id, block index, offset), checked against the table by D's agent
 * before a byte is copied; a refused write is dropped and reported through
 * on_am_event. The claim (pd_kvx_am_complete) follows the writes on the same
 * endpoint and is accepted once exactly the claimed bytes have landed (a
 * claim that overtakes its writes waits for them). Quarantine then only
 * waits for receives already in progress, not for the writer.
 *
 * Which path: one-sided puts are the primary one. They are the zero-copy
 * path on RDMA and for GPU memory (no receiver CPU, no bounce buffer), and
 * on one host a put into a pool from pd_kvx_alloc_pool is a single memcpy
 * through a shared mapping (≈ memcpy speed). UCX 1.13 has no true RMA into
 * malloc'd memory over shm or TCP — it emulates puts with active messages
 * — and there the AM path is faster (receiver-side rendezvous) and refuses
 * each write before it lands. Measured in docs/benchmarks.md.
 *
 * Integrity limits, stated plainly: one remote key covers the whole pool,
 * so a buggy writer could write outside its grant; this module checks every
 * put against the pool bounds on the writer side, and the table makes sure
 * such data is never used, but it cannot stop a rogue writer. The worker
 * address and rkey blobs are validated (framing, lengths), the UCX bytes
 * inside them are opaque and trusted as coming from a registered replica.
 *
 * Peer failure with UCX 1.13: UCX's own peer-failure detection
 * (UCP_ERR_HANDLING_MODE_PEER, keepalive) is not supported by its shared
 * memory transports (posix, sysv, cma): asking for it makes UCX pick TCP
 * even between processes of one host, and with shared memory only, endpoint
 * creation fails. So an endpoint that cannot get it falls back to
 * UCP_ERR_HANDLING_MODE_NONE (pd_kvx_config.no_ucx_peer_failure skips the
 * attempt, for shared memory on one host), and this module watches the
 * peer's process itself (pidfd) when both live on the same host and pid
 * namespace. Across hosts without UCX peer-failure support, the service's
 * heartbeats must call pd_kvx_peer_fail.
 */
#ifndef PD_KVTRANSFER_H
#define PD_KVTRANSFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd_common.h"

typedef struct pd_kvx_agent pd_kvx_agent;
typedef struct pd_kvx_pool pd_kvx_pool;
typedef struct pd_kvx_peer pd_kvx_peer;
typedef struct pd_kvx_reservations pd_kvx_reservations;

/* ------------------------------------------------------------------ */
/* 1. the agent                                                        */
/* ------------------------------------------------------------------ */

/** Called once per peer, from pd_kvx_agent_progress, when the peer fails:
 * its UCX endpoint reported an error, its process exited (same-host peers),
 * or pd_kvx_peer_fail was called. Every operation outstanding on the peer
 * has had its callback (with PD_ERR_IO) before this runs. reason is
 * borrowed for the call. The peer stays valid until pd_kvx_peer_close. */
typedef void (*pd_kvx_peer_failed_cb)(void *user, pd_kvx_peer *peer, pd_status st,
                                      const char *reason);

typedef struct {
    const char *name;        /* for logs ("decode0.rank0"); NULL: "kvx" */
    const char *transports;  /* UCX_TLS for this agent ("shm", "tcp", "rc,sm"); NULL: UCX's
                                choice, which the UCX_TLS environment variable overrides */
    const char *net_devices; /* UCX_NET_DEVICES ("lo", "mlx5_0:1"); NULL: all */
    /* true: never ask UCX for peer-failure handling (UCP_ERR_HANDLING_MODE_PEER),
     * so that same-host peers may use shared memory even when UCX_TLS also
     * lists tcp or RDMA (with PEER mode UCX 1.13 drops shm and cma); dead peers
     * are then found by pidfd (same host) or pd_kvx_peer_fail. false: ask, and
     * fall back per endpoint when no transport can give it. */
    bool no_ucx_peer_failure;
    pd_kvx_peer_failed_cb on_peer_failed; /* may be NULL */
    void *user;                           /* passed to on_peer_failed */
} pd_kvx_config;

/** Creates an agent: a ucp context (RMA | AM | WAKEUP) and one worker in
 * UCS_THREAD_MODE_SINGLE. The caller owns the agent (pd_kvx_agent_free).
 * Errors: PD_ERR_INVALID (cfg NULL, or UCX rejected the transports or
 * net_devices value), PD_ERR_IO (ucp_config_read, ucp_init,
 * ucp_worker_create, ucp_worker_get_efd, epoll/eventfd failed; err has the
 * UCX status text), PD_ERR_UNSUPPORTED (transports names none that UCX has
 * here — err says to look at `ucx_info -d`). */
pd_status pd_kvx_agent_init(const pd_kvx_config *cfg, pd_kvx_agent **a_p, pd_err *err);

/** Closes every peer (forcibly), destroys the worker and the context, and
 * sets *a_p to NULL. Operations still outstanding get their callbacks with
 * PD_ERR_IO first (on_peer_failed is not called). Free the pools first;
 * any left are unmapped here, with a warning. Waits at most about a second
 * for endpoints to close. Not from a callback. NULL or *a_p NULL is a
 * no-op. */
void pd_kvx_agent_free(pd_kvx_agent **a_p);

/** The blob a replica publishes at registration so that peers can connect:
 * a small framed header (magic, version, pid, host and pid-namespace ids)
 * followed by the UCX worker address. Borrowed: owned by the agent, valid
 * until pd_kvx_agent_free. Bytes. Never fails. */
void pd_kvx_agent_worker_address(const pd_kvx_agent *a, const void **bytes_p, size_t *len_p);

/** A file descriptor to watch for readability (libevent EV_READ|EV_PERSIST,
 * zmq_pollitem_t.fd with ZMQ_POLLIN). When it is readable, or after any call
 * that starts an operation, call pd_kvx_agent_progress. Level-triggered;
 * owned by the agent. Never fails. */
int pd_kvx_agent_event_fd(const pd_kvx_agent *a);

/** Drives the agent: drains ucp_worker_progress, notices dead peers, runs
 * every due callback (operations, peer failure, active-message reports),
 * then arms the worker (ucp_worker_arm). Returns true when more work remains
 * and the caller should call again before waiting on the event fd (arm
 * answered BUSY, or a callback queued more). Must not be called from a
 * callback of this module. */
bool pd_kvx_agent_progress(pd_kvx_agent *a);

/* ------------------------------------------------------------------ */
/* 2. memory and peers                                                 */
/* ------------------------------------------------------------------ */

/** Registers [base, base + bytes) with ucp_mem_map (host memory now) and
 * packs its remote key. Register the KV pool once: on the decode side it is
 * the target of writes; on the prefill side registering the source pool lets
 * puts from it go zero-copy. base is borrowed and must outlive the pool.
 * The caller owns the pool (pd_kvx_pool_free, before pd_kvx_agent_free).
 * Errors: PD_ERR_INVALID (NULL base, zero bytes, or a range that overlaps a
 * pool already registered with this agent), PD_ERR_IO (ucp_mem_map or
 * ucp_rkey_pack failed). */
pd_status pd_kvx_register_pool(pd_kvx_agent *a, void *base, size_t bytes, pd_kvx_pool **pool_p,
                               pd_err *err);

/** Allocates bytes of host memory through UCX (ucp_mem_map with
 * UCP_MEM_MAP_ALLOCATE) and registers it as a pool. UCX takes it from
 * shared memory (sysv, then posix), so a writer on the same host puts into
 * it with one memcpy through a mapping; into malloc'd memory UCX 1.13 can
 * only emulate puts over shared memory with active messages, which needs
 * the target's CPU (docs/benchmarks.md has both). The memory belongs to the
 * pool (pd_kvx_pool_base), its contents are unspecified, and it goes with
 * pd_kvx_pool_free. In containers the shared memory limits (docker
 * --shm-size, kernel.shmmax) must allow it.
 * Errors: PD_ERR_INVALID (zero bytes), PD_ERR_NOMEM (UCX could not allocate),
 * PD_ERR_IO (ucp_mem_query or ucp_rkey_pack failed). */
pd_status pd_kvx_alloc_pool(pd_kvx_agent *a, size_t bytes, pd_kvx_pool **pool_p, pd_err *err);

/** The pool's first byte (the base given to pd_kvx_register_pool, or the
 * memory pd_kvx_alloc_pool allocated). */
void *pd_kvx_pool_base(const pd_kvx_pool *pool);

/** The remote-key blob the decode replica sends to each writer: a framed
 * header (magic, version, pool bytes) and the packed UCX rkey. Borrowed:
 * owned by the pool. Never fails. */
void pd_kvx_pool_rkey(const pd_kvx_pool *pool, const void **bytes_p, size_t *len_p);

/** Unmaps the pool and sets *pool_p to NULL. Writes by peers into it must
 * have stopped (the reservation protocol guarantees it for decode pools).
 * NULL is a no-op. */
void pd_kvx_pool_free(pd_kvx_pool **pool_p);

/** Connects to a peer from its worker-address blob (ucp_ep_create by worker
 * address). The blob is borrowed for the call. user is kept for the
 * caller (pd_kvx_peer_user). The peer is owned by the agent and released
 * with pd_kvx_peer_close. Connection setup completes asynchronously; writes
 * may be issued at once.
 * Errors: PD_ERR_FORMAT (blob too short, bad magic, version or length),
 * PD_ERR_IO (ucp_ep_create failed: no common transport — err names the UCX
 * status). */
pd_status pd_kvx_peer_connect(pd_kvx_agent *a, const void *addr_blob, size_t len, void *user,
                              pd_kvx_peer **peer_p, pd_err *err);

/** Attaches the peer's pool remote key (the blob from pd_kvx_pool_rkey on
 * the peer). Once per peer; the blob is borrowed for the call. Puts address
 * the remote pool by offset (bytes from its start), bounds-checked against
 * the pool size carried in the blob.
 * Errors: PD_ERR_FORMAT (malformed blob), PD_ERR_INVALID (the peer already
 * has a key, or it failed), PD_ERR_IO (ucp_ep_rkey_unpack failed). */
pd_status pd_kvx_peer_add_rkey(pd_kvx_peer *peer, const void *rkey_blob, size_t len, pd_err *err);

/** The user pointer given to pd_kvx_peer_connect. */
void *pd_kvx_peer_user(const pd_kvx_peer *peer);

/** Whether the peer has failed (see pd_kvx_peer_failed_cb). */
bool pd_kvx_peer_failed(const pd_kvx_peer *peer);

/** Declares the peer failed (e.g. its heartbeats stopped): outstanding
 * operations complete with PD_ERR_IO and on_peer_failed runs, both from the
 * next pd_kvx_agent_progress; later writes are refused. reason is copied.
 * Idempotent. */
void pd_kvx_peer_fail(pd_kvx_peer *peer, const char *reason);

/** Closes the connection and sets *peer_p to NULL; the peer must not be
 * used again. A healthy peer is closed gracefully (outstanding operations
 * finish and get their callbacks); a failed one is released forcibly. The
 * remaining work finishes in pd_kvx_agent_progress. NULL is a no-op. */
void pd_kvx_peer_close(pd_kvx_peer **peer_p);

/* ------------------------------------------------------------------ */
/* 3. writes                                                           */
/* ------------------------------------------------------------------ */

/** Completion of one operation: called exactly once, from
 * pd_kvx_agent_progress, with the tag given when it started. st is PD_OK,
 * or PD_ERR_IO when the peer failed or was closed before the operation
 * completed. */
typedef void (*pd_kvx_done_cb)(void *user, uint64_t tag, pd_status st);

/** One piece of a batched write: bytes from local to the peer's pool at
 * remote_offset (bytes from the start of the peer's registered pool). */
typedef struct {
    const void *local;
    uint64_t remote_offset;
    size_t bytes;
} pd_kvx_iov;

/** Writes bytes from local to the peer's pool at remote_offset with
 * ucp_put_nbx. cb fires when the put is locally complete: local may be
 * reused. It does NOT mean the data is visible remotely — that is what
 * pd_kvx_flush is for. local is borrowed until cb. tag is the caller's
 * (e.g. a request tag) and comes back in cb.
 * Errors (cb will not fire): PD_ERR_INVALID (no rkey yet, zero bytes, no
 * cb, or [remote_offset, +bytes) outside the remote pool), PD_ERR_IO (the
 * peer has failed or is closing, or UCX refused the put at once).
 * Speed: puts into a pool from pd_kvx_alloc_pool on the same host are one
 * memcpy; into malloc'd memory over shm or TCP UCX 1.13 emulates them with
 * active messages (the target's progress does the copy). */
pd_status pd_kvx_put(pd_kvx_peer *peer, const void *local, size_t bytes, uint64_t remote_offset,
                     uint64_t tag, pd_kvx_done_cb cb, void *user, pd_err *err);

/** Writes n pieces as one operation (one ucp_put_nbx each, all in flight
 * together); cb fires once when all are locally complete, with the first
 * error if any failed. The array is borrowed for the call, the local
 * buffers until cb. Every piece is checked before any is issued.
 * Errors (cb will not fire): those of pd_kvx_put, for any piece; n == 0;
 * no cb. If UCX refuses a piece after earlier ones were issued, the call
 * returns PD_OK (err says which piece) and cb reports PD_ERR_IO. */
pd_status pd_kvx_put_batch(pd_kvx_peer *peer, const pd_kvx_iov *iov, size_t n, uint64_t tag,
                           pd_kvx_done_cb cb, void *user, pd_err *err);

/** Flushes the endpoint (ucp_ep_flush_nbx): cb fires with PD_OK once every
 * put issued on this peer before the call is complete at the target —
 * visible in its memory. Only then may "KV complete" be sent.
 * Errors (cb will not fire): PD_ERR_INVALID (no cb), PD_ERR_IO (the peer
 * has failed or is closing, or UCX refused the flush). */
pd_status pd_kvx_flush(pd_kvx_peer *peer, uint64_t tag, pd_kvx_done_cb cb, void *user, pd_err *err);

/* ------------------------------------------------------------------ */
/* 4. reservations (decode side)                                       */
/* ------------------------------------------------------------------ */

#define PD_KVX_REQUEST_ID_MAX 64 /* bytes of a request id, without the NUL */

typedef enum {
    PD_KVX_RESV_LIVE = 1, /* writes and a claim are expected */
    PD_KVX_RESV_COMPLETE, /* claim accepted; blocks belong to the decode sequence */
    PD_KVX_RESV_RELEASED, /* released by D (abort, request ended) */
    PD_KVX_RESV_EXPIRED,  /* deadline passed, or its writer died, before a claim */
} pd_kvx_resv_state;

/** Answer to a write or a claim. */
typedef enum {
    PD_KVX_ACCEPTED = 0,
    PD_KVX_REFUSED_UNKNOWN,    /* no such (request id, reservation id) */
    PD_KVX_REFUSED_EXPIRED,    /* past its deadline, or its writer died */
    PD_KVX_REFUSED_RELEASED,   /* released by the decode side */
    PD_KVX_REFUSED_COMPLETED,  /* already complete: a write or claim after the claim */
    PD_KVX_REFUSED_WRITER,     /* from a writer other than the one it was granted to */
    PD_KVX_REFUSED_RANGE,      /* block index or byte range outside the reservation */
    PD_KVX_REFUSED_INCOMPLETE, /* claim names more bytes than have landed (AM path) */
} pd_kvx_verdict;

/** Static name of a verdict ("accepted", "unknown reservation", ...). */
const char *pd_kvx_verdict_str(pd_kvx_verdict v);

/** Static name of a state ("live", "complete", "released", "expired"). */
const char *pd_kvx_resv_state_str(pd_kvx_resv_state s);

typedef struct {
    /* Blocks of a reservation that never completed may be reused now (state
     * RELEASED or EXPIRED and its writer quiescent). Called exactly once
     * per such reservation; blocks borrowed for the call. Must not call
     * into the table. Required. */
    void (*blocks_free)(void *user, const char *request_id, uint64_t resv_id, const int32_t *blocks,
                        size_t n_blocks);
    /* A receiver-validated (AM) write or claim was refused, or a claim was
     * accepted (v == PD_KVX_ACCEPTED: the reservation is COMPLETE). Called
     * from pd_kvx_agent_progress, or from pd_kvx_resv_release / _expire /
     * _writer_gone / _complete / _check_write when they end an AM claim that
     * was waiting for its bytes. detail borrowed. Must not call into the
     * table. May be NULL. */
    void (*on_am_event)(void *user, const char *request_id, uint64_t resv_id, pd_kvx_verdict v,
                        const char *detail);
    void *user;
    size_t block_bytes; /* bytes of one KV block (AM path: block index → offset); >0 */
    size_t remembered;  /* finished reservations remembered so that a late claim is
                           refused as released/expired, not unknown; 0: 4096 */
    double reclaim_after_s; /* one-sided puts: a RELEASED or EXPIRED reservation whose writer
                               never said it stopped is handed back this long after its
                               deadline (its lease has ended: pd_kvx_lease_margin_s of the
                               ttl; see the protocol, step 5); 0: never (only a fence, a
                               claim or writer_gone hand it back) */
} pd_kvx_resv_config;

/** The writer's lease for a reservation of ttl_s: ttl_s - pd_kvx_lease_margin_s
 * (seconds; > 0 and < ttl_s for ttl_s > 0). */
double pd_kvx_lease_s(double ttl_s);

/** The margin between the writer's lease and the reservation's ttl, and
 * between the deadline and the hand-back of a reservation nobody fenced:
 * ttl_s / 4 (seconds). */
double pd_kvx_lease_margin_s(double ttl_s);

/** Counters, for metrics and tests. */
typedef struct {
    size_t live, complete, quarantined; /* quarantined: released/expired, writer not yet quiet */
    uint64_t refused;                   /* refusals of every kind since init */
} pd_kvx_resv_stats;

/** Flags of pd_kvx_resv_create. */
enum {
    PD_KVX_RESV_AM = 1u << 0, /* writes arrive as receiver-validated active messages */
};

/** Creates an empty table. The caller owns it (pd_kvx_resv_free).
 * Errors: PD_ERR_INVALID (cfg NULL, no blocks_free, block_bytes 0,
 * reclaim_after_s negative or not finite). */
pd_status pd_kvx_resv_init(const pd_kvx_resv_config *cfg, pd_kvx_reservations **t_p, pd_err *err);

/** Frees the table and sets *t_p to NULL. Blocks still held are not handed
 * back (the pool goes with it). NULL is a no-op. */
void pd_kvx_resv_free(pd_kvx_reservations **t_p);

/** Reserves blocks (ids into the decode pool, copied) for request_id, to be
 * written by writer (the caller's id of the prefill rank) until
 * now_s + ttl_s (seconds, pd_now_s clock). flags: 0 for one-sided puts, or
 * PD_KVX_RESV_AM. *resv_id_p receives the new, never-reused id.
 * Errors: PD_ERR_INVALID (request id empty or longer than
 * PD_KVX_REQUEST_ID_MAX, no blocks, a negative block id, ttl_s <= 0). */
pd_status pd_kvx_resv_create(pd_kvx_reservations *t, const char *request_id, uint64_t writer,
                             const int32_t *blocks, size_t n_blocks, double ttl_s, double now_s,
                             unsigned flags, uint64_t *resv_id_p, pd_err *err);

/** Judges a "KV complete" claim from writer for (request_id, resv_id), for
 * bytes_written bytes (checked on the AM path; one-sided: pass 0).
 * PD_KVX_ACCEPTED: LIVE and in time → COMPLETE; the blocks (see
 * pd_kvx_resv_get) now belong to the caller. Otherwise the claim is refused,
 * err says why (state, deadline, writer), nothing changes except: a LIVE
 * reservation found past its deadline becomes EXPIRED, and a claim from the
 * granted writer marks it quiescent (it flushed before claiming), which may
 * hand its blocks to blocks_free. */
pd_kvx_verdict pd_kvx_resv_complete(pd_kvx_reservations *t, const char *request_id,
                                    uint64_t resv_id, uint64_t writer, uint64_t bytes_written,
                                    double now_s, pd_err *err);

/** Judges a claim to write block_index (an index into the reservation's
 * block list, not a pool block id) at [offset, offset + bytes) of that
 * block: LIVE, in time, the granted writer, inside the block. On
 * PD_KVX_ACCEPTED, *pool_offset_p is the byte offset in the pool to write.
 * Refusals as pd_kvx_resv_complete (plus RANGE), with err set. Changes
 * nothing but LIVE → EXPIRED past the deadline. */
pd_kvx_verdict pd_kvx_resv_check_write(pd_kvx_reservations *t, const char *request_id,
                                       uint64_t resv_id, uint64_t writer, uint32_t block_index,
                                       uint64_t offset, uint64_t bytes, double now_s,
                                       uint64_t *pool_offset_p, pd_err *err);

/** D releases a reservation (Abort, or the request ended). LIVE → RELEASED
 * (blocks quarantined until the writer is quiet); COMPLETE → RELEASED (the
 * caller already owns the blocks; nothing is handed back); EXPIRED stays
 * EXPIRED. Later claims are refused.
 * Errors: PD_ERR_NOTFOUND (no such reservation, or already released). */
pd_status pd_kvx_resv_release(pd_kvx_reservations *t, const char *request_id, uint64_t resv_id,
                              pd_err *err);

/** The writer says it has stopped writing into this reservation and its
 * flush completed (Fenced), or D knows the Grant never reached it.
 * Releases the blocks if the reservation is RELEASED or EXPIRED.
 * Errors: PD_ERR_NOTFOUND (unknown), PD_ERR_INVALID (writer is not the
 * grantee). */
pd_status pd_kvx_resv_fenced(pd_kvx_reservations *t, const char *request_id, uint64_t resv_id,
                             uint64_t writer, pd_err *err);

/** The writer is gone (its peer failed, or its heartbeats stopped): each of
 * its LIVE reservations becomes EXPIRED, and every reservation of it that is
 * RELEASED or EXPIRED hands its blocks back. Returns how many reservations
 * were handed back. */
size_t pd_kvx_resv_writer_gone(pd_kvx_reservations *t, uint64_t writer);

/** Expires every LIVE reservation whose deadline is before now_s
 * (→ EXPIRED, quarantined until its writer is quiet; the caller tells the
 * writer), and, with cfg.reclaim_after_s > 0, hands back (blocks_free) every
 * RELEASED or EXPIRED reservation whose deadline + reclaim_after_s is before
 * now_s: its writer's lease has ended. Returns how many expired (not how
 * many were handed back). Call from a timer. */
size_t pd_kvx_resv_expire(pd_kvx_reservations *t, double now_s);

/** Looks a reservation up. *state_p, and the borrowed block list (valid
 * until the table changes) through blocks_p / n_blocks_p, each optional.
 * Errors: PD_ERR_NOTFOUND (unknown, or forgotten). */
pd_status pd_kvx_resv_get(const pd_kvx_reservations *t, const char *request_id, uint64_t resv_id,
                          pd_kvx_resv_state *state_p, const int32_t **blocks_p, size_t *n_blocks_p);

/** Current counters. */
pd_kvx_resv_stats pd_kvx_resv_stats_get(const pd_kvx_reservations *t);

/* ------------------------------------------------------------------ */
/* receiver-validated writes (active messages)                         */
/* ------------------------------------------------------------------ */

/** One block write on the AM path: bytes from local into the reservation's
 * block_index-th block (index into the grant's block list) at offset. */
typedef struct {
    const void *local;
    uint32_t block_index;
    uint32_t offset;
    uint32_t bytes;
} pd_kvx_block_write;

/** D: accepts receiver-validated writes into pool (registered with this
 * agent) for reservations of t. Each incoming write is checked with
 * pd_kvx_resv_check_write before its bytes are copied into the pool; a
 * refused one is dropped and reported through t's on_am_event. Claims are
 * judged with pd_kvx_resv_complete once their bytes have landed. t and pool
 * are borrowed and must outlive the agent's use of them (until
 * pd_kvx_agent_free). Once per agent.
 * Errors: PD_ERR_INVALID (already set), PD_ERR_IO (the AM handler could not
 * be installed). */
pd_status pd_kvx_agent_accept_writes(pd_kvx_agent *a, pd_kvx_reservations *t, pd_kvx_pool *pool,
                                     pd_err *err);

/** P: sends n block writes for (request_id, resv_id) as one operation
 * (ucp_am_send_nbx each); cb fires once when all are locally complete.
 * Local buffers borrowed until cb; the array for the call.
 * Errors (cb will not fire): PD_ERR_INVALID (n == 0, a zero-byte write, a
 * bad request id), PD_ERR_IO (the peer failed or is closing, or UCX refused
 * the send at once). */
pd_status pd_kvx_am_write(pd_kvx_peer *peer, const char *request_id, uint64_t resv_id,
                          uint64_t writer, const pd_kvx_block_write *w, size_t n, uint64_t tag,
                          pd_kvx_done_cb cb, void *user, pd_err *err);

/** P: sends the "KV complete" claim for bytes_written bytes on the same
 * endpoint, after the writes. D accepts it once those bytes have landed and
 * reports through on_am_event. cb fires when the claim has left (locally
 * complete). Errors: as pd_kvx_am_write. */
pd_status pd_kvx_am_complete(pd_kvx_peer *peer, const char *request_id, uint64_t resv_id,
                             uint64_t writer, uint64_t bytes_written, uint64_t tag,
                             pd_kvx_done_cb cb, void *user, pd_err *err);

#endif
