/*
 * net.c: see net.h.
 */
#include "net.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

int rnnd_net_split(const char *addr, char *host, size_t hostlen, char *port, size_t portlen) {
    const char *colon = strrchr(addr, ':');
    if (colon == NULL || colon == addr || colon[1] == '\0')
        return -1;
    size_t n = (size_t)(colon - addr);
    const char *h = addr;
    if (h[0] == '[' && n >= 2 && h[n - 1] == ']') {
        h++;
        n -= 2;
    }
    if (n + 1 > hostlen || strlen(colon + 1) + 1 > portlen)
        return -1;
    memcpy(host, h, n);
    host[n] = '\0';
    snprintf(port, portlen, "%s", colon + 1);
    return 0;
}

int rnnd_net_listen(const char *host, const char *port, int backlog) {
    struct addrinfo hints = {
        .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE};
    struct addrinfo *res = NULL;
    if (getaddrinfo(host && host[0] ? host : NULL, port, &hints, &res) != 0) {
        errno = EADDRNOTAVAIL;
        return -1;
    }
    int fd = -1, e = EADDRNOTAVAIL;
    for (struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            e = errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, backlog) != 0) {
            e = errno;
            close(fd);
            fd = -1;
            if (e == EADDRINUSE)
                break;
        }
    }
    freeaddrinfo(res);
    if (fd < 0)
        errno = e;
    return fd;
}

void rnnd_net_tune(int fd, int idle_s) {
    int one = 1, intvl = idle_s / 2 > 0 ? idle_s / 2 : 1, cnt = 3;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
}
