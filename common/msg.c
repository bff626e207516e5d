#include "pd_msg.h"

#include <errno.h>
#include <string.h>
#include <zmq.h>

static const ProtobufCMessageDescriptor *descriptors[PD_MSG_COUNT] = {
    [PD_MSG_REGISTER] = &pdserve__register__descriptor,
    [PD_MSG_REGISTER_REPLY] = &pdserve__register_reply__descriptor,
    [PD_MSG_HEARTBEAT] = &pdserve__heartbeat__descriptor,
    [PD_MSG_GENERATE] = &pdserve__generate__descriptor,
    [PD_MSG_RESERVE] = &pdserve__reserve__descriptor,
    [PD_MSG_RESERVE_REPLY] = &pdserve__reserve_reply__descriptor,
    [PD_MSG_PREFILL] = &pdserve__prefill__descriptor,
    [PD_MSG_KV_COMPLETE] = &pdserve__kv_complete__descriptor,
    [PD_MSG_TOKENS] = &pdserve__tokens__descriptor,
    [PD_MSG_ABORT] = &pdserve__abort__descriptor,
};

/* zmq's calls fail with EINTR when a signal arrives during them (a
 * replica's SIGTERM handler, libFuzzer's timer: fuzz_msg saw "zmq recv:
 * Interrupted system call"); each is tried again then, so that a message is
 * never cut between its frames nor a ready one reported as an error. */
static int send_part(void *sock, const void *p, size_t n, int flags) {
    int rc;
    while ((rc = zmq_send(sock, p, n, flags)) < 0 && errno == EINTR)
        ;
    return rc;
}

static int recv_part(zmq_msg_t *m, void *sock, int flags) {
    int rc;
    while ((rc = zmq_msg_recv(m, sock, flags)) < 0 && errno == EINTR)
        ;
    return rc;
}

const char *pd_msg_type_name(pd_msg_type t) {
    static const char *names[PD_MSG_COUNT] = {"none",    "Register", "RegisterReply", "Heartbeat",
                                              "Generate", "Reserve", "ReserveReply",  "Prefill",
                                              "KvComplete", "Tokens", "Abort"};
    return (t > 0 && t < PD_MSG_COUNT) ? names[t] : "unknown";
}

pd_status pd_msg_send(void *sock, const void *envelope, size_t envelope_len, pd_msg_type t,
                      const ProtobufCMessage *msg) {
    if (t <= PD_MSG_NONE || t >= PD_MSG_COUNT || !msg || msg->descriptor != descriptors[t])
        return PD_ERR_INVALID;
    size_t n = protobuf_c_message_get_packed_size(msg);
    unsigned char stackbuf[4096];
    unsigned char *buf = n <= sizeof stackbuf ? stackbuf : malloc(n);
    if (!buf)
        return PD_ERR_NOMEM;
    protobuf_c_message_pack(msg, buf);
    unsigned char type = (unsigned char)t;
    int rc = 0;
    if (envelope)
        rc = send_part(sock, envelope, envelope_len, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    if (rc >= 0)
        rc = send_part(sock, &type, 1, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    if (rc >= 0)
        rc = send_part(sock, buf, n, ZMQ_DONTWAIT);
    if (buf != stackbuf)
        free(buf);
    if (rc < 0)
        return errno == EAGAIN ? PD_ERR_LIMIT : PD_ERR_IO;
    return PD_OK;
}

/* Reads and drops the remaining frames of a message. */
static void drain(void *sock) {
    int more = 1;
    size_t ml = sizeof more;
    while (zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &ml) == 0 && more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        recv_part(&m, sock, 0);
        zmq_msg_close(&m);
    }
}

static bool has_more(void *sock) {
    int more = 0;
    size_t ml = sizeof more;
    return zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &ml) == 0 && more;
}

pd_status pd_msg_recv(void *sock, bool with_envelope, pd_msg *out, pd_err *err) {
    memset(out, 0, sizeof *out);
    zmq_msg_t part;
    zmq_msg_init(&part);
    if (recv_part(&part, sock, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&part);
        return errno == EAGAIN ? PD_ERR_LIMIT : pd_err_set(err, PD_ERR_IO, "zmq recv: %s", zmq_strerror(errno));
    }
    if (with_envelope) {
        size_t n = zmq_msg_size(&part);
        if (n > sizeof out->envelope || !has_more(sock)) {
            zmq_msg_close(&part);
            drain(sock);
            return pd_err_set(err, PD_ERR_FORMAT, "message without a type frame (or envelope of %zu bytes)", n);
        }
        memcpy(out->envelope, zmq_msg_data(&part), n);
        out->envelope_len = n;
        zmq_msg_close(&part);
        zmq_msg_init(&part);
        if (recv_part(&part, sock, 0) < 0) {
            zmq_msg_close(&part);
            return pd_err_set(err, PD_ERR_IO, "zmq recv: %s", zmq_strerror(errno));
        }
    }
    if (zmq_msg_size(&part) != 1 || !has_more(sock)) {
        zmq_msg_close(&part);
        drain(sock);
        return pd_err_set(err, PD_ERR_FORMAT, "malformed message: the type frame must be 1 byte followed by a payload");
    }
    unsigned t = *(unsigned char *)zmq_msg_data(&part);
    zmq_msg_close(&part);
    zmq_msg_init(&part);
    if (recv_part(&part, sock, 0) < 0) {
        zmq_msg_close(&part);
        return pd_err_set(err, PD_ERR_IO, "zmq recv: %s", zmq_strerror(errno));
    }
    bool extra = has_more(sock);
    if (extra)
        drain(sock);
    if (t == 0 || t >= PD_MSG_COUNT || extra) {
        zmq_msg_close(&part);
        return pd_err_set(err, PD_ERR_FORMAT, "malformed message: type %u%s", t, extra ? " with extra frames" : "");
    }
    ProtobufCMessage *m =
        protobuf_c_message_unpack(descriptors[t], NULL, zmq_msg_size(&part), zmq_msg_data(&part));
    zmq_msg_close(&part);
    if (!m)
        return pd_err_set(err, PD_ERR_FORMAT, "malformed %s payload", pd_msg_type_name((pd_msg_type)t));
    out->type = (pd_msg_type)t;
    out->msg = m;
    return PD_OK;
}

void pd_msg_clear(pd_msg *out) {
    if (out->msg)
        protobuf_c_message_free_unpacked(out->msg, NULL);
    out->msg = NULL;
    out->type = PD_MSG_NONE;
}
