/* The replica's heartbeat thread (common/heartbeat.c) against a fake
 * gateway (a ZeroMQ ROUTER in the test): heartbeats carry the registration
 * set with pd_hb_set_registration, and a "register again" refusal asks for
 * a new registration only when it answers a heartbeat of the current one
 * (a refusal of a heartbeat the gateway read before the Register, or sent
 * while unregistered, would make the replica register twice). */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include <cmocka.h>

#include "pd_heartbeat.h"
#include "pd_msg.h"

#define HB_MS 20

typedef struct {
    void *zctx, *router;
    pd_hb *hb;
} fixture;

/* The next heartbeat whose registration is want (earlier ones, sent before
 * a change, are skipped); its envelope in *env. False after 2 s. */
static bool next_beat(fixture *f, uint64_t want, pd_msg *out) {
    for (int i = 0; i < 2000; i++) {
        pd_err err;
        if (pd_msg_recv(f->router, true, out, &err) == PD_OK) {
            if (out->type == PD_MSG_HEARTBEAT) {
                const Pdserve__Heartbeat *h = (const Pdserve__Heartbeat *)out->msg;
                assert_string_equal(h->replica_id, "r-1");
                if (h->registration == want)
                    return true;
            }
            pd_msg_clear(out);
            continue;
        }
        usleep(1000);
    }
    return false;
}

/* Answers the heartbeat beat as the router does for a replica it does not
 * know, naming registration echo. */
static void refuse(fixture *f, const pd_msg *beat, uint64_t echo) {
    Pdserve__RegisterReply rep = PDSERVE__REGISTER_REPLY__INIT;
    rep.accepted = false;
    rep.reason = "unknown replica: register again";
    rep.heartbeat_registration = echo;
    assert_int_equal(pd_msg_send(f->router, beat->envelope, beat->envelope_len,
                                 PD_MSG_REGISTER_REPLY, &rep.base),
                     PD_OK);
}

/* Whether pd_hb_take_reregister turns true within ms. */
static bool reregister_within(fixture *f, int ms) {
    for (int i = 0; i < ms; i++) {
        if (pd_hb_take_reregister(f->hb))
            return true;
        usleep(1000);
    }
    return false;
}

static int setup(void **state) {
    fixture *f = calloc(1, sizeof *f);
    f->zctx = zmq_ctx_new();
    f->router = zmq_socket(f->zctx, ZMQ_ROUTER);
    int linger = 0;
    zmq_setsockopt(f->router, ZMQ_LINGER, &linger, sizeof linger);
    char ep[64];
    snprintf(ep, sizeof ep, "inproc://hb-test-%d", (int)getpid());
    if (zmq_bind(f->router, ep) != 0)
        return -1;
    pd_err err = {{0}};
    if (pd_hb_start(f->zctx, ep, "r-1", HB_MS, &f->hb, &err) != PD_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    *state = f;
    return 0;
}

static int teardown(void **state) {
    fixture *f = *state;
    pd_hb_stop(&f->hb);
    zmq_close(f->router);
    zmq_ctx_term(f->zctx);
    free(f);
    return 0;
}

static void test_refusals_of_the_current_registration_only(void **state) {
    fixture *f = *state;
    pd_msg b;

    /* not registered yet: beats carry 0; their refusal is stale (the
     * Register in flight answers it) */
    assert_true(next_beat(f, 0, &b));
    refuse(f, &b, 0);
    pd_msg_clear(&b);
    assert_false(reregister_within(f, 200));

    /* registered (1): a refusal of a beat sent before it is ignored, one of
     * a beat sent under it asks once */
    pd_hb_set_registration(f->hb, 1);
    assert_true(next_beat(f, 1, &b));
    refuse(f, &b, 0);
    assert_false(reregister_within(f, 200));
    refuse(f, &b, 1);
    pd_msg_clear(&b);
    assert_true(reregister_within(f, 2000));
    assert_false(pd_hb_take_reregister(f->hb)); /* once */

    /* registering again (0), then registered (2): refusals of beats of the
     * lost registration 1 are ignored, one of 2 asks */
    pd_hb_set_registration(f->hb, 0);
    assert_true(next_beat(f, 0, &b));
    refuse(f, &b, 1);
    pd_msg_clear(&b);
    assert_false(reregister_within(f, 200));
    pd_hb_set_registration(f->hb, 2);
    assert_true(next_beat(f, 2, &b));
    refuse(f, &b, 1);
    assert_false(reregister_within(f, 200));
    refuse(f, &b, 2);
    pd_msg_clear(&b);
    assert_true(reregister_within(f, 2000));

    /* a refusal not yet taken when the replica starts registering again is
     * dropped: that registration answers it */
    assert_true(next_beat(f, 2, &b));
    refuse(f, &b, 2);
    pd_msg_clear(&b);
    for (int i = 0; i < 200; i++)
        usleep(1000); /* the thread has read it */
    pd_hb_set_registration(f->hb, 0);
    assert_false(pd_hb_take_reregister(f->hb));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_refusals_of_the_current_registration_only),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
