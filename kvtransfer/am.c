/* Receiver-validated writes: each block write is an active message whose
 * header names (request id, reservation id, writer, block index, offset);
 * the decode agent checks it against the reservation table before copying
 * a byte. Eager messages are copied in the handler; rendezvous ones are
 * received straight into the block (ucp_am_recv_data_nbx). A refused
 * rendezvous message is simply not received: returning UCS_OK without
 * ucp_am_recv_data_nbx makes UCX answer the sender, and nothing lands. */
#include "kvx_impl.h"

#include <string.h>

#define KVX_AM_ID    7
#define KVX_AM_MAGIC 0x5758564bu /* "KVXW" */
#define KVX_AM_VER   1

enum { KVX_AM_WRITE = 1, KVX_AM_CLAIM = 2 };

typedef struct {
    uint32_t magic;
    uint16_t version;
    uint16_t kind;
    uint64_t resv_id;
    uint64_t writer;
    uint64_t bytes; /* write: payload bytes; claim: bytes written in all */
    uint32_t block_index;
    uint32_t offset;
    char request_id[PD_KVX_REQUEST_ID_MAX + 8]; /* NUL-terminated, zero-padded */
} kvx_am_hdr;

/* A rendezvous receive in flight into a block of reservation r. */
typedef struct kvx_am_recv {
    struct kvx_am_recv *prev, *next;
    pd_kvx_agent *agent;
    kvx_resv *resv;
    uint64_t bytes;
    bool detached; /* agent shutting down: do not touch the table */
} kvx_am_recv;

static void recv_finish(kvx_am_recv *rec, ucs_status_t status) {
    pd_kvx_agent *a = rec->agent;
    if (rec->prev)
        rec->prev->next = rec->next;
    else
        a->am_recvs = rec->next;
    if (rec->next)
        rec->next->prev = rec->prev;
    if (!rec->detached) {
        if (status != UCS_OK)
            PD_LOGW(KVX_LOG, "%s: AM block receive failed: %s", a->name, ucs_status_string(status));
        kvx_resv_write_end(a->am_table, rec->resv, status == UCS_OK ? rec->bytes : 0);
    }
    free(rec);
}

static void recv_done_cb(void *request, ucs_status_t status, size_t length, void *user_data) {
    (void)length; /* the whole block: its size is in the record */
    ucp_request_free(request);
    recv_finish(user_data, status);
}

static ucs_status_t am_recv_cb(void *arg, const void *header, size_t header_length, void *data,
                               size_t length, const ucp_am_recv_param_t *param) {
    pd_kvx_agent *a = arg;
    pd_kvx_reservations *t = a->am_table;
    kvx_am_hdr h;
    if (header_length != sizeof h) {
        PD_LOGW(KVX_LOG, "%s: dropped an AM write with a %zu-byte header", a->name, header_length);
        return UCS_OK;
    }
    memcpy(&h, header, sizeof h);
    if (h.magic != KVX_AM_MAGIC || h.version != KVX_AM_VER ||
        !memchr(h.request_id, 0, sizeof h.request_id)) {
        PD_LOGW(KVX_LOG, "%s: dropped a malformed AM write header", a->name);
        return UCS_OK;
    }
    double now = pd_now_s();
    if (h.kind == KVX_AM_CLAIM) {
        kvx_resv_am_claim(t, h.request_id, h.resv_id, h.writer, h.bytes, now);
        return UCS_OK;
    }
    pd_err e = {{0}};
    uint64_t off = 0;
    pd_kvx_verdict v = PD_KVX_REFUSED_RANGE;
    if (h.kind != KVX_AM_WRITE || h.bytes != length)
        pd_err_set(&e, PD_ERR_FORMAT, "kvx: AM message kind %u with %llu of %zu bytes", h.kind,
                   (unsigned long long)h.bytes, length);
    else
        v = pd_kvx_resv_check_write(t, h.request_id, h.resv_id, h.writer, h.block_index, h.offset,
                                    length, now, &off, &e);
    const pd_kvx_pool *pool = a->am_pool;
    if (v == PD_KVX_ACCEPTED && (!pool || off > pool->bytes || length > pool->bytes - off)) {
        v = PD_KVX_REFUSED_RANGE;
        pd_err_set(&e, PD_ERR_INVALID, "kvx: block write at pool offset %llu is outside the pool",
                   (unsigned long long)off);
    }
    if (v != PD_KVX_ACCEPTED) {
        PD_LOGW(KVX_LOG, "%s: refused AM write: %s", a->name, e.msg);
        kvx_resv_report(t, h.request_id, h.resv_id, v, e.msg);
        return UCS_OK;
    }
    kvx_resv *r = kvx_resv_find(t, h.request_id, h.resv_id);
    uint8_t *dst = pool->base + off;
    kvx_resv_write_begin(r);
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        memcpy(dst, data, length);
        kvx_resv_write_end(t, r, length);
        return UCS_OK;
    }
    kvx_am_recv *rec = pd_xcalloc(1, sizeof *rec);
    rec->agent = a;
    rec->resv = r;
    rec->bytes = length;
    rec->next = a->am_recvs;
    if (a->am_recvs)
        a->am_recvs->prev = rec;
    a->am_recvs = rec;
    ucp_request_param_t prm = {
        .op_attr_mask =
            UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH,
        .cb.recv_am = recv_done_cb,
        .user_data = rec,
        .memh = pool->memh,
    };
    void *req = ucp_am_recv_data_nbx(a->worker, data, dst, length, &prm);
    if (req == NULL)
        recv_finish(rec, UCS_OK);
    else if (UCS_PTR_IS_ERR(req))
        recv_finish(rec, UCS_PTR_STATUS(req));
    return UCS_OK;
}

pd_status pd_kvx_agent_accept_writes(pd_kvx_agent *a, pd_kvx_reservations *t, pd_kvx_pool *pool,
                                     pd_err *err) {
    if (a->am_table)
        return pd_err_set(err, PD_ERR_INVALID, "kvx %s: already accepting writes", a->name);
    if (!t || !pool || pool->agent != a)
        return pd_err_set(err, PD_ERR_INVALID,
                          "kvx %s: accept_writes needs a table and a pool "
                          "of this agent",
                          a->name);
    ucp_am_handler_param_t hp = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                      UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG,
        .id = KVX_AM_ID,
        .flags = UCP_AM_FLAG_WHOLE_MSG,
        .cb = am_recv_cb,
        .arg = a,
    };
    ucs_status_t s = ucp_worker_set_am_recv_handler(a->worker, &hp);
    if (s != UCS_OK)
        return pd_err_set(err, PD_ERR_IO, "kvx %s: ucp_worker_set_am_recv_handler: %s", a->name,
                          ucs_status_string(s));
    a->am_table = t;
    a->am_pool = pool;
    return PD_OK;
}

void kvx_am_shutdown(pd_kvx_agent *a) {
    for (kvx_am_recv *rec = a->am_recvs; rec; rec = rec->next)
        rec->detached = true;
}

void kvx_am_free(pd_kvx_agent *a) {
    while (a->am_recvs) {
        kvx_am_recv *rec = a->am_recvs;
        a->am_recvs = rec->next;
        free(rec);
    }
}

/* ---- the writer's side ------------------------------------------------------ */

static pd_status hdr_init(kvx_am_hdr *h, const char *request_id, uint64_t resv_id, uint64_t writer,
                          uint16_t kind, pd_err *err) {
    size_t n = request_id ? strnlen(request_id, PD_KVX_REQUEST_ID_MAX + 1) : 0;
    if (n == 0 || n > PD_KVX_REQUEST_ID_MAX)
        return pd_err_set(err, PD_ERR_INVALID, "kvx: request id must be 1..%d bytes",
                          PD_KVX_REQUEST_ID_MAX);
    memset(h, 0, sizeof *h);
    h->magic = KVX_AM_MAGIC;
    h->version = KVX_AM_VER;
    h->kind = kind;
    h->resv_id = resv_id;
    h->writer = writer;
    memcpy(h->request_id, request_id, n);
    return PD_OK;
}

/* Sends n messages (headers hdrs, payloads from w or none) as one op. */
static pd_status am_send(pd_kvx_peer *p, kvx_am_hdr *hdrs, const pd_kvx_block_write *w, size_t n,
                         uint64_t tag, pd_kvx_done_cb cb, void *user, pd_err *err) {
    pd_kvx_agent *a = p->agent;
    kvx_op *op = kvx_op_new(p, tag, cb, user);
    op->header = hdrs; /* must outlive the sends: freed with the op */
    for (size_t i = 0; i < n; i++) {
        const void *buf = w ? w[i].local : NULL;
        size_t len = w ? w[i].bytes : 0;
        ucp_request_param_t prm;
        kvx_req_param(a, op, buf, len, &prm);
        op->pending++;
        op->posted++;
        void *r = ucp_am_send_nbx(p->ep, KVX_AM_ID, &hdrs[i], sizeof hdrs[i], buf, len, &prm);
        if (UCS_PTR_IS_ERR(r)) {
            op->pending--;
            op->posted--;
            op->st = PD_ERR_IO;
            pd_err_set(err, PD_ERR_IO, "kvx %s: ucp_am_send_nbx (message %zu): %s", a->name, i,
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

pd_status pd_kvx_am_write(pd_kvx_peer *p, const char *request_id, uint64_t resv_id, uint64_t writer,
                          const pd_kvx_block_write *w, size_t n, uint64_t tag, pd_kvx_done_cb cb,
                          void *user, pd_err *err) {
    if (!w || n == 0 || !cb)
        return pd_err_set(err, PD_ERR_INVALID, "kvx: AM write needs blocks and a callback");
    for (size_t i = 0; i < n; i++)
        if (!w[i].local || w[i].bytes == 0)
            return pd_err_set(err, PD_ERR_INVALID, "kvx: AM write %zu is empty", i);
    pd_status st = kvx_peer_usable(p, err);
    if (st != PD_OK)
        return st;
    kvx_am_hdr *hdrs = pd_xmalloc(n * sizeof *hdrs);
    for (size_t i = 0; i < n; i++) {
        if ((st = hdr_init(&hdrs[i], request_id, resv_id, writer, KVX_AM_WRITE, err)) != PD_OK) {
            free(hdrs);
            return st;
        }
        hdrs[i].block_index = w[i].block_index;
        hdrs[i].offset = w[i].offset;
        hdrs[i].bytes = w[i].bytes;
    }
    return am_send(p, hdrs, w, n, tag, cb, user, err);
}

pd_status pd_kvx_am_complete(pd_kvx_peer *p, const char *request_id, uint64_t resv_id,
                             uint64_t writer, uint64_t bytes_written, uint64_t tag,
                             pd_kvx_done_cb cb, void *user, pd_err *err) {
    if (!cb)
        return pd_err_set(err, PD_ERR_INVALID, "kvx: AM claim needs a callback");
    pd_status st = kvx_peer_usable(p, err);
    if (st != PD_OK)
        return st;
    kvx_am_hdr *h = pd_xmalloc(sizeof *h);
    if ((st = hdr_init(h, request_id, resv_id, writer, KVX_AM_CLAIM, err)) != PD_OK) {
        free(h);
        return st;
    }
    h->bytes = bytes_written;
    return am_send(p, h, NULL, 1, tag, cb, user, err);
}
