/*
 * net.h: the TCP pieces that the cluster channel (cluster.c), the HTTP server (http.c) and the
 * socket regions' data connections (shm.c) share: splitting HOST:PORT, a listening socket, and
 * the options of a long-lived connection.
 */
#ifndef RNND_NET_H
#define RNND_NET_H

#include <stddef.h>

// Splits "HOST:PORT" ("[v6]:PORT" too, the brackets dropped) into host and port. 0, or -1 when
// addr is not that or a part does not fit.
int rnnd_net_split(const char *addr, char *host, size_t hostlen, char *port, size_t portlen);

// A listening TCP socket (SO_REUSEADDR, close-on-exec) on the first of host's addresses that
// binds (host NULL or "": every interface). The descriptor, or -1 with errno set: EADDRINUSE as
// soon as one address is in use, EADDRNOTAVAIL when host does not resolve.
int rnnd_net_listen(const char *host, const char *port, int backlog);

// TCP_NODELAY, and keepalive probes once the peer was silent for idle_s seconds (every idle_s/2
// seconds, three of them): a peer that vanished without closing is noticed in about 2.5 * idle_s.
void rnnd_net_tune(int fd, int idle_s);

#endif // RNND_NET_H
