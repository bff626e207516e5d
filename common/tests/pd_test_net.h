/* Helpers for the tests in common/tests that talk to a server over
 * loopback TCP. Include after <cmocka.h> (the helpers assert with it). */
#ifndef PD_TEST_NET_H
#define PD_TEST_NET_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

/* A TCP port on 127.0.0.1 that was free when asked: a socket bound to port
 * 0, its port read back, the socket closed. Another process may take it
 * afterwards. Fails the running test if the socket calls fail. */
static inline int pd_test_free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    assert_true(fd >= 0);
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    close(fd);
    return ntohs(a.sin_port);
}

#endif
