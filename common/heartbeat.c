#include "pd_heartbeat.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

struct pd_hb {
    void *sock;
    char replica_id[128];
    pthread_t thread;
    pthread_mutex_t mu;
    Pdserve__Heartbeat snap; /* numeric fields only */
    atomic_int interval_ms;
    atomic_ullong registration; /* pd_hb_set_registration; heartbeats carry it */
    atomic_bool stop, reregister, displaced;
    uint32_t pid;
};

static void *hb_main(void *arg) {
    pd_hb *hb = arg;
    double next = pd_now_s();
    while (!atomic_load(&hb->stop)) {
        double now = pd_now_s();
        if (now >= next) {
            Pdserve__Heartbeat h;
            pthread_mutex_lock(&hb->mu);
            h = hb->snap;
            pthread_mutex_unlock(&hb->mu);
            h.replica_id = hb->replica_id;
            h.registration = atomic_load(&hb->registration);
            h.pid = hb->pid;
            pd_msg_send(hb->sock, NULL, 0, PD_MSG_HEARTBEAT, &h.base);
            next = now + atomic_load(&hb->interval_ms) / 1000.0;
        }
        long wait = (long)((next - pd_now_s()) * 1000.0);
        if (wait > 50) wait = 50; /* notice stop quickly */
        if (wait < 0) wait = 0;
        zmq_pollitem_t it = {hb->sock, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, wait) > 0) {
            pd_msg m;
            pd_err err = {{0}};
            while (pd_msg_recv(hb->sock, false, &m, &err) == PD_OK) {
                /* A refusal of a heartbeat sent before the current
                 * registration (the gateway read it before the Register) or
                 * while unregistered (the Register in flight, or its retry,
                 * answers it) is stale: registering again would only
                 * register twice. */
                const Pdserve__RegisterReply *rep = (const Pdserve__RegisterReply *)m.msg;
                uint64_t cur = atomic_load(&hb->registration);
                if (m.type == PD_MSG_REGISTER_REPLY && !rep->accepted && rep->displaced)
                    atomic_store(&hb->displaced, true);
                else if (m.type == PD_MSG_REGISTER_REPLY && !rep->accepted && cur != 0 &&
                         rep->heartbeat_registration == cur)
                    atomic_store(&hb->reregister, true);
                pd_msg_clear(&m);
            }
        }
    }
    return NULL;
}

pd_status pd_hb_start(void *zctx, const char *endpoint, const char *replica_id, int interval_ms, pd_hb **hb_p,
                      pd_err *err) {
    if (interval_ms <= 0)
        return pd_err_set(err, PD_ERR_INVALID, "heartbeat interval must be positive");
    pd_hb *hb = pd_xcalloc(1, sizeof *hb);
    Pdserve__Heartbeat init = PDSERVE__HEARTBEAT__INIT;
    hb->snap = init;
    snprintf(hb->replica_id, sizeof hb->replica_id, "%s", replica_id);
    atomic_init(&hb->interval_ms, interval_ms);
    atomic_init(&hb->stop, false);
    atomic_init(&hb->reregister, false);
    atomic_init(&hb->displaced, false);
    hb->pid = (uint32_t)getpid();
    atomic_init(&hb->registration, 0);
    pthread_mutex_init(&hb->mu, NULL);
    hb->sock = zmq_socket(zctx, ZMQ_DEALER);
    char ident[160];
    /* the pid too: a second process under the same replica id must not take
     * this socket's identity over (ZMQ_ROUTER_HANDOVER), or the gateway's
     * answer to this process (RegisterReply.displaced) would reach the other */
    snprintf(ident, sizeof ident, "%s#hb#%u", replica_id, hb->pid);
    int linger = 0;
    zmq_setsockopt(hb->sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(hb->sock, ZMQ_ROUTING_ID, ident, strlen(ident));
    if (!hb->sock || zmq_connect(hb->sock, endpoint) != 0) {
        pd_status st = pd_err_set(err, PD_ERR_IO, "heartbeat socket to %s: %s", endpoint, zmq_strerror(zmq_errno()));
        if (hb->sock) zmq_close(hb->sock);
        free(hb);
        return st;
    }
    if (pthread_create(&hb->thread, NULL, hb_main, hb) != 0) {
        zmq_close(hb->sock);
        free(hb);
        return pd_err_set(err, PD_ERR_IO, "cannot start the heartbeat thread");
    }
    *hb_p = hb;
    return PD_OK;
}

void pd_hb_update(pd_hb *hb, const Pdserve__Heartbeat *snap) {
    pthread_mutex_lock(&hb->mu);
    ProtobufCMessage base = hb->snap.base;
    hb->snap = *snap;
    hb->snap.base = base;
    hb->snap.replica_id = NULL;
    pthread_mutex_unlock(&hb->mu);
}

void pd_hb_set_interval(pd_hb *hb, int interval_ms) {
    if (interval_ms > 0) atomic_store(&hb->interval_ms, interval_ms);
}

void pd_hb_set_registration(pd_hb *hb, uint64_t registration) {
    atomic_store(&hb->registration, registration);
    if (registration == 0) atomic_store(&hb->reregister, false);
}

bool pd_hb_take_reregister(pd_hb *hb) {
    return atomic_exchange(&hb->reregister, false);
}

bool pd_hb_displaced(pd_hb *hb) {
    return atomic_load(&hb->displaced);
}

void pd_hb_stop(pd_hb **hb_p) {
    if (!hb_p || !*hb_p) return;
    pd_hb *hb = *hb_p;
    atomic_store(&hb->stop, true);
    pthread_join(hb->thread, NULL);
    zmq_close(hb->sock);
    pthread_mutex_destroy(&hb->mu);
    free(hb);
    *hb_p = NULL;
}
