/* Test and benchmark helpers: framed messages over a socketpair between a
 * parent and a child it re-executed (a fresh process: UCX is not safe to
 * use in a child forked after UCX was initialised), and the child spawn. */
#ifndef KVX_SOCK_H
#define KVX_SOCK_H

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

/* One message: u32 type, u32 length, bytes. */
static inline int kvx_sock_send(int fd, uint32_t type, const void *buf, uint32_t len) {
    uint32_t h[2] = {type, len};
    if (send(fd, h, sizeof h, MSG_NOSIGNAL) != (ssize_t)sizeof h)
        return -1;
    const uint8_t *p = buf;
    while (len > 0) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n <= 0)
            return -1;
        p += n;
        len -= (uint32_t)n;
    }
    return 0;
}

static inline int kvx_read_full(int fd, void *buf, size_t len, int timeout_ms) {
    uint8_t *p = buf;
    while (len > 0) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int r = poll(&pfd, 1, timeout_ms);
        if (r == 0)
            return -2; /* timed out */
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        ssize_t n = read(fd, p, len);
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Receives one message into a malloc'd buffer (*buf_p, caller frees).
 * Returns 0, -1 (EOF/error) or -2 (timeout). */
static inline int kvx_sock_recv(int fd, uint32_t *type_p, void **buf_p, uint32_t *len_p,
                                int timeout_ms) {
    uint32_t h[2];
    int r = kvx_read_full(fd, h, sizeof h, timeout_ms);
    if (r)
        return r;
    void *b = malloc(h[1] ? h[1] : 1);
    if (!b)
        return -1;
    if (h[1] && (r = kvx_read_full(fd, b, h[1], timeout_ms)) != 0) {
        free(b);
        return r;
    }
    *type_p = h[0];
    *buf_p = b;
    *len_p = h[1];
    return 0;
}

/* Runs `self --kvx-child role arg...` with the child's end of a socketpair
 * on fd 3. The child dies with its parent. Returns the pid; *fd_p is the
 * parent's end. */
static inline pid_t kvx_spawn_child(const char *role, const char *a1, const char *a2,
                                    const char *a3, int *fd_p) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        return -1;
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (dup2(sv[1], 3) < 0)
            _exit(126);
        execl("/proc/self/exe", "kvx-child", "--kvx-child", role, a1 ? a1 : "-", a2 ? a2 : "-",
              a3 ? a3 : "-", (char *)NULL);
        _exit(127);
    }
    close(sv[1]);
    *fd_p = sv[0];
    return pid;
}

#endif
