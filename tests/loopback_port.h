/*
 * loopback_port.h: a loopback TCP port that was free a moment ago (bound, then closed), for tests
 * that need a port nothing listens on or one to hand a daemon before it starts. Another process
 * may take it meanwhile; the tests that use it tolerate that.
 */
#ifndef RNND_TESTS_LOOPBACK_PORT_H
#define RNND_TESTS_LOOPBACK_PORT_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

static inline int loopback_free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    bind(fd, (struct sockaddr *)&sa, sizeof sa);
    socklen_t len = sizeof sa;
    getsockname(fd, (struct sockaddr *)&sa, &len);
    close(fd);
    return ntohs(sa.sin_port);
}

#endif
