/* The one read/write pair for messages between services: ZeroMQ multipart
 * frames [envelope (ROUTER side)] [type byte] [protobuf-c payload], a
 * descriptor table indexed by type, and free_unpacked called in one place
 * (pd_msg_clear). Schema: proto/pdserve.proto. */
#ifndef PD_MSG_H
#define PD_MSG_H

#include <stdbool.h>
#include <stddef.h>

#include "pd_common.h"
#include "pdserve.pb-c.h"

typedef enum {
    PD_MSG_NONE = 0,
    PD_MSG_REGISTER,
    PD_MSG_REGISTER_REPLY,
    PD_MSG_HEARTBEAT,
    PD_MSG_GENERATE,
    PD_MSG_RESERVE,
    PD_MSG_RESERVE_REPLY,
    PD_MSG_PREFILL,
    PD_MSG_KV_COMPLETE,
    PD_MSG_TOKENS,
    PD_MSG_ABORT,
    PD_MSG_COUNT
} pd_msg_type;

/** A received message: type, the sender's envelope (ROUTER sockets), and the
 * unpacked protobuf (owned; free with pd_msg_clear). */
typedef struct {
    pd_msg_type type;
    unsigned char envelope[256];
    size_t envelope_len;
    ProtobufCMessage *msg;
} pd_msg;

/** Name of a message type, for logs. */
const char *pd_msg_type_name(pd_msg_type t);

/** Sends msg of type t on a ZeroMQ socket. envelope/envelope_len: the peer
 * identity for ROUTER sockets, NULL/0 for DEALER. Borrows msg (the caller
 * still owns it). Non-blocking: a full queue is PD_ERR_LIMIT.
 * Errors: PD_ERR_INVALID (type/descriptor mismatch), PD_ERR_LIMIT, PD_ERR_IO. */
pd_status pd_msg_send(void *sock, const void *envelope, size_t envelope_len, pd_msg_type t,
                      const ProtobufCMessage *msg);

/** Receives one message without blocking. with_envelope: the socket is a
 * ROUTER (first frame is the identity). Returns PD_ERR_LIMIT when nothing is
 * waiting (EAGAIN); PD_ERR_FORMAT for a malformed message (wrong frame
 * count, unknown type, payload that does not unpack) — the frames are
 * consumed and err says why. On success out owns the message. */
pd_status pd_msg_recv(void *sock, bool with_envelope, pd_msg *out, pd_err *err);

/** Frees out->msg (protobuf free_unpacked) and resets out. Safe to repeat. */
void pd_msg_clear(pd_msg *out);

#endif
