/*
 * loopback_port.h: a loopback TCP port that was free a moment ago (bound, then closed), for tests
 * that need a port nothing listens on or one to hand a daemon before it starts. Another process
 * may take it meanwhile; the tests that use it tolerate that.
 *
 * The port comes from below the kernel's ephemeral range, drawn at random: a port that bind()
 * chose (port 0) and the test then closed is the one the kernel hands the next bind() to port 0,
 * such as a daemon's own --http 127.0.0.1:0, which then sat on the port the test gave another
 * daemon for its rendezvous (a two-daemon test failed so, once).
 */
#ifndef RNND_TESTS_LOOPBACK_PORT_H
#define RNND_TESTS_LOOPBACK_PORT_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

// Whether port (0: any) binds on loopback; its number in *got.
static inline int loopback_bind_probe(int port, int *got) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons((uint16_t)port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int ok = fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
    socklen_t len = sizeof sa;
    if (ok && getsockname(fd, (struct sockaddr *)&sa, &len) == 0)
        *got = ntohs(sa.sin_port);
    if (fd >= 0)
        close(fd);
    return ok;
}

static inline int loopback_free_port(void) {
    static unsigned s; // this file's draws in this process
    int lo = 32768, got = 0;
    FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
    if (f) {
        if (fscanf(f, "%d", &lo) != 1)
            lo = 32768;
        fclose(f);
    }
    if (s == 0)
        s = (unsigned)getpid() * 2654435761u ^ (unsigned)time(NULL);
    for (int k = 0; k < 200 && lo > 12000; k++) { // [10000, lo)
        s = s * 1103515245u + 12345u;
        int port = 10000 + (int)((s >> 8) % (unsigned)(lo - 10000));
        if (loopback_bind_probe(port, &got))
            return port;
    }
    loopback_bind_probe(0, &got); // the whole range below 12000 ephemeral, or all of it taken
    return got;
}

#endif
