/*
 * floorrelay: the least a TCP proxy can do, as a floor for make bench.
 *
 * One thread, one epoll set, level-triggered: for each client it connects
 * to the upstream port and copies bytes both ways, one read and one write
 * per readable event, no parsing, no buffering beyond one read. It is not
 * a usable proxy (no protocol awareness, writes block, no limits): it
 * measures what any relay hop costs on this machine, so that the ratios of
 * pgfence and PgBouncer to a direct connection can be read against the
 * ratio no relay can beat.
 *
 * Usage: floorrelay LISTEN_PORT UPSTREAM_PORT (both on 127.0.0.1).
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAXFD 65536

static int peer[MAXFD];
/* gen[fd] counts the closes of fd. An event carries the gen its fd had
 * when registered, so an event of a batch whose fd was closed earlier in
 * the same batch (and perhaps reused at once by accept or dial) is told
 * from one for the fd's new connection: reading the new socket on the old
 * one's event would block the relay until the server gave up on it. */
static uint32_t gen[MAXFD];

static uint64_t tag(int fd) { return (uint64_t)gen[fd] << 32 | (uint32_t)fd; }

static int dial(int port) {
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	if (fd < 0 || fd >= MAXFD || connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
		if (fd >= 0)
			close(fd);
		return -1;
	}
	int one = 1;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
	return fd;
}

static int writeall(int fd, const char *p, ssize_t n) {
	while (n > 0) {
		ssize_t w = write(fd, p, n);
		if (w <= 0)
			return -1;
		p += w;
		n -= w;
	}
	return 0;
}

int main(int argc, char **argv) {
	if (argc != 3) {
		fprintf(stderr, "usage: floorrelay LISTEN_PORT UPSTREAM_PORT\n");
		return 2;
	}
	int up = atoi(argv[2]);
	int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
	setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[1]))};
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (bind(ls, (struct sockaddr *)&a, sizeof a) < 0 || listen(ls, 128) < 0) {
		perror("floorrelay: listen");
		return 1;
	}
	int ep = epoll_create1(0);
	struct epoll_event ev = {.events = EPOLLIN, .data.u64 = tag(ls)};
	epoll_ctl(ep, EPOLL_CTL_ADD, ls, &ev);
	printf("ready\n");
	fflush(stdout);
	static char buf[65536];
	struct epoll_event evs[64];
	for (;;) {
		int n = epoll_wait(ep, evs, 64, -1);
		for (int i = 0; i < n; i++) {
			int fd = (int)(uint32_t)evs[i].data.u64;
			if ((uint32_t)(evs[i].data.u64 >> 32) != gen[fd])
				continue; /* fd was closed earlier in this batch */
			if (fd == ls) {
				int c = accept(ls, NULL, NULL);
				if (c < 0)
					continue;
				int u = c < MAXFD ? dial(up) : -1;
				if (u < 0) {
					perror("floorrelay: dial");
					close(c);
					continue;
				}
				setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
				peer[c] = u;
				peer[u] = c;
				struct epoll_event e1 = {.events = EPOLLIN, .data.u64 = tag(c)};
				struct epoll_event e2 = {.events = EPOLLIN, .data.u64 = tag(u)};
				epoll_ctl(ep, EPOLL_CTL_ADD, c, &e1);
				epoll_ctl(ep, EPOLL_CTL_ADD, u, &e2);
				continue;
			}
			ssize_t r = read(fd, buf, sizeof buf);
			if (r > 0 && writeall(peer[fd], buf, r) == 0)
				continue;
			if (r < 0)
				perror("floorrelay: read");
			else if (r > 0)
				perror("floorrelay: write");
			int p = peer[fd];
			close(fd);
			close(p);
			peer[fd] = peer[p] = -1;
			gen[fd]++;
			gen[p]++;
		}
	}
}
