/* Replica liveness: a thread per replica that sends Heartbeat messages to
 * the gateway on its own ZeroMQ socket, so that a long forward step (a big
 * prefill chunk on a CPU can take seconds) never makes a healthy replica
 * look dead. The service's loop publishes its load with pd_hb_update after
 * each step; the thread sends the latest snapshot every interval. When the
 * gateway answers a heartbeat with "register again" (it restarted, or it
 * had declared the replica dead), pd_hb_take_reregister returns true once.
 *
 * Heartbeats and the Register travel on different sockets, so the gateway
 * may read a heartbeat before the Register sent just after it and refuse
 * it. Each heartbeat therefore carries the replica's registration number
 * (pd_hb_set_registration) and the refusal echoes it: only a refusal of a
 * heartbeat sent under the current registration asks for a new one. A
 * registration that really was lost is refused again at the next
 * heartbeat. */
#ifndef PD_HEARTBEAT_H
#define PD_HEARTBEAT_H

#include <stdbool.h>

#include "pd_common.h"
#include "pd_msg.h"

typedef struct pd_hb pd_hb;

/** Starts the thread: a DEALER socket (identity "<replica_id>#hb#<pid>") in zctx
 * connected to endpoint. interval_ms > 0. Errors: PD_ERR_IO (socket,
 * connect or thread creation failed; err says which). */
pd_status pd_hb_start(void *zctx, const char *endpoint, const char *replica_id, int interval_ms, pd_hb **hb_p,
                      pd_err *err);
/** Copies the numeric load fields of snap (replica_id is ignored). Thread-safe. */
void pd_hb_update(pd_hb *hb, const Pdserve__Heartbeat *snap);
/** Changes the period (the gateway's RegisterReply names it). */
void pd_hb_set_interval(pd_hb *hb, int interval_ms);
/** The replica's registration: n > 0 after its n-th accepted RegisterReply,
 * 0 while it is not registered (then refusals are ignored, and one not yet
 * taken is dropped: the replica is registering anyway). Thread-safe. */
void pd_hb_set_registration(pd_hb *hb, uint64_t registration);
/** True once after the gateway refused a heartbeat sent under the current
 * registration (it restarted, or it had declared the replica dead). */
bool pd_hb_take_reregister(pd_hb *hb);
/** True once the gateway answered a heartbeat with RegisterReply.displaced:
 * another process (another pid) registered this replica id since. */
bool pd_hb_displaced(pd_hb *hb);
/** Stops and joins the thread, closes its socket, sets *hb_p to NULL. */
void pd_hb_stop(pd_hb **hb_p);

#endif
