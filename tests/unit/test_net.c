/*
 * test_net.c: server/net.c, the TCP pieces the cluster channel, the HTTP server and the socket
 * regions' data connections share: HOST:PORT split (IPv4, bracketed IPv6, refusals), a listening
 * socket (any free port, a port in use reported as EADDRINUSE, a host that does not resolve),
 * and the connection options read back.
 */
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>

#include "net.h"

static void test_split(void **state) {
    (void)state;
    char host[16], port[8];
    assert_int_equal(rnnd_net_split("127.0.0.1:50051", host, sizeof host, port, sizeof port), 0);
    assert_string_equal(host, "127.0.0.1");
    assert_string_equal(port, "50051");
    assert_int_equal(rnnd_net_split("[::1]:7", host, sizeof host, port, sizeof port), 0);
    assert_string_equal(host, "::1");
    assert_string_equal(port, "7");
    const char *bad[] = {"nohost", ":80", "host:", "a-name-too-long-for-it:1", "h:123456789"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_int_equal(rnnd_net_split(bad[i], host, sizeof host, port, sizeof port), -1);
}

static int port_of(int fd) {
    struct sockaddr_in a;
    socklen_t n = sizeof a;
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &n), 0);
    return ntohs(a.sin_port);
}

static void test_listen_and_tune(void **state) {
    (void)state;
    int fd = rnnd_net_listen("127.0.0.1", "0", 4);
    assert_true(fd >= 0);
    char port[8];
    snprintf(port, sizeof port, "%d", port_of(fd));
    errno = 0;
    assert_int_equal(rnnd_net_listen("127.0.0.1", port, 4), -1);
    assert_int_equal(errno, EADDRINUSE);
    assert_int_equal(rnnd_net_listen("no-such-host.invalid", "0", 4), -1);
    assert_int_equal(errno, EADDRNOTAVAIL);

    int c = socket(AF_INET, SOCK_STREAM, 0);
    rnnd_net_tune(c, 60);
    int v = 0;
    socklen_t n = sizeof v;
    assert_int_equal(getsockopt(c, IPPROTO_TCP, TCP_KEEPIDLE, &v, &n), 0);
    assert_int_equal(v, 60);
    assert_int_equal(getsockopt(c, IPPROTO_TCP, TCP_KEEPINTVL, &v, &n), 0);
    assert_int_equal(v, 30);
    assert_int_equal(getsockopt(c, SOL_SOCKET, SO_KEEPALIVE, &v, &n), 0);
    assert_int_equal(v, 1);
    assert_int_equal(getsockopt(c, IPPROTO_TCP, TCP_NODELAY, &v, &n), 0);
    assert_int_equal(v, 1);
    close(c);
    close(fd);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_split),
        cmocka_unit_test(test_listen_and_tune),
    };
    return cmocka_run_group_tests_name("net", tests, NULL, NULL);
}
