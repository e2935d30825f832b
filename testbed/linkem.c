/*
 * linkem: one-way delay, jitter and loss for the packets that cross a TUN device.
 *
 * The test bed's router namespace routes every packet between hosts into a TUN device;
 * this program reads each one, holds it for the sum of its source's and its destination's
 * access-link delay (each plus a uniform jitter in [-jitter, +jitter]), drops it with the
 * probability that either access link loses it, and writes it back into the TUN, from
 * where the kernel routes it on. A (source, destination) pair's release times never
 * decrease, so jitter never reorders a flow (netem does the same when given a rate): a
 * packet closer behind the one before than the jitter leaves no earlier than it, so a busy
 * flow's delays lean towards delay + jitter. Rates are left to the hosts' tbf qdiscs.
 *
 *   linkem --tun NAME [--host ADDR,DELAY_MS,JITTER_MS,LOSS]... [--seed N] [--slots N]
 *          [--control]
 *   linkem --fd N ...     (an inherited datagram socket instead of a TUN device: tests)
 *
 * Addresses that are not given have no delay and no loss. Counters go to stdout as one
 * JSON line on SIGUSR1 and at exit (SIGTERM, SIGINT). With --control, stdin takes lines
 * `host ADDR DELAY_MS JITTER_MS LOSS` (add or change a host), `stats`, and `reset` (the
 * counters, then zeroed: one measurement each), each answered by one JSON line, and its
 * end (the owner is gone) ends the program. Counters count what waits on the device too:
 * it is read first, so that stats taken after a transfer has been sent include all of it.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <time.h>
#include <unistd.h>

#define SLOT 2048     /* bytes per queued packet: the links' MTU is 1500 */
#define BATCH 64      /* packets read before due ones are released again */
#define MAX_HOSTS 65536

struct host { uint32_t addr; int64_t delay_ns, jitter_ns; double loss; };
struct item { int64_t t; uint64_t seq; uint32_t slot, len; };
struct counters {
    uint64_t packets, bytes, sent, drops, overflow, other, write_errors;
    uint64_t queue_peak, queue_bytes, queue_peak_bytes, late_max_ns, late_sum_ns;
};

/* Host 0 stands for every address not given: no delay, no loss. */
static struct host *hosts;
static uint32_t nhosts = 1, cap_hosts;
static uint32_t *index_keys, *index_vals, index_mask; /* address -> host, open addressing */
static int64_t *last;                                  /* [src * cap + dst]: last release */

static unsigned char *slots;
static uint32_t *free_slots, nfree, nslots;
static struct item *heap;
static uint32_t heap_n;
static uint64_t seq, rng;
static struct counters c;

static void die(const char *what) {
    fprintf(stderr, "linkem: %s: %s\n", what, strerror(errno));
    exit(1);
}

static void *alloc(size_t n) {
    void *p = calloc(1, n ? n : 1);
    if (!p) die("out of memory");
    return p;
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static double uniform(void) { /* splitmix64: [0, 1) */
    uint64_t z = (rng += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return (double)((z ^ (z >> 31)) >> 11) * 0x1.0p-53;
}

/* -- hosts ------------------------------------------------------------------------------ */
static uint32_t slot_of(uint32_t addr) { return (addr * 2654435761u) & index_mask; }

static uint32_t host_of(uint32_t addr) {
    for (uint32_t h = slot_of(addr);; h = (h + 1) & index_mask) {
        if (index_vals[h] == 0) return 0;
        if (index_keys[h] == addr) return index_vals[h];
    }
}

/* Room for `want` hosts: the index keeps a load under 1/2, the pair table is copied so
 * that queued flows keep their order. */
static void grow(uint32_t want) {
    if (want <= cap_hosts) return;
    uint32_t cap = cap_hosts ? cap_hosts : 16;
    while (cap < want) cap *= 2;
    int64_t *pairs = alloc((size_t)cap * cap * sizeof *pairs);
    for (uint32_t s = 0; s < cap_hosts; s++)
        memcpy(pairs + (size_t)s * cap, last + (size_t)s * cap_hosts, cap_hosts * sizeof *last);
    free(last);
    last = pairs;
    hosts = realloc(hosts, cap * sizeof *hosts);
    if (!hosts) die("out of memory");
    free(index_keys);
    free(index_vals);
    index_mask = 2 * cap - 1;
    index_keys = alloc(2 * (size_t)cap * sizeof *index_keys);
    index_vals = alloc(2 * (size_t)cap * sizeof *index_vals);
    for (uint32_t i = 1; i < nhosts; i++) {
        uint32_t h = slot_of(hosts[i].addr);
        while (index_vals[h]) h = (h + 1) & index_mask;
        index_keys[h] = hosts[i].addr;
        index_vals[h] = i;
    }
    cap_hosts = cap;
}

/* Add or change the host at `addr` (dotted quad); 0 on success. */
static int set_host(const char *addr, double delay_ms, double jitter_ms, double loss) {
    struct in_addr in;
    if (inet_pton(AF_INET, addr, &in) != 1 || !(delay_ms >= 0) || !(jitter_ms >= 0) ||
        !(loss >= 0 && loss <= 1) || nhosts >= MAX_HOSTS)
        return -1;
    grow(nhosts + 1);
    uint32_t i = host_of(in.s_addr);
    if (i == 0) {
        i = nhosts++;
        uint32_t h = slot_of(in.s_addr);
        while (index_vals[h]) h = (h + 1) & index_mask;
        index_keys[h] = in.s_addr;
        index_vals[h] = i;
    }
    hosts[i] = (struct host){in.s_addr, (int64_t)(delay_ms * 1e6), (int64_t)(jitter_ms * 1e6),
                             loss};
    return 0;
}

/* -- the queue: a min-heap on (release time, arrival order) ------------------------------ */
static int before(const struct item *a, const struct item *b) {
    return a->t < b->t || (a->t == b->t && a->seq < b->seq);
}

static void push(struct item it) {
    uint32_t i = heap_n++;
    while (i > 0) {
        uint32_t parent = (i - 1) / 2;
        if (!before(&it, &heap[parent])) break;
        heap[i] = heap[parent];
        i = parent;
    }
    heap[i] = it;
}

static struct item pop(void) {
    struct item top = heap[0], tail = heap[--heap_n];
    uint32_t i = 0;
    for (;;) {
        uint32_t kid = 2 * i + 1;
        if (kid >= heap_n) break;
        if (kid + 1 < heap_n && before(&heap[kid + 1], &heap[kid])) kid++;
        if (!before(&heap[kid], &tail)) break;
        heap[i] = heap[kid];
        i = kid;
    }
    if (heap_n) heap[i] = tail;
    return top;
}

/* -- forwarding ------------------------------------------------------------------------- */
static int64_t jitter(int64_t j) { return j ? (int64_t)((2 * uniform() - 1) * (double)j) : 0; }

/* Queue (or drop) the packet just read into `slot`, `len` bytes, at time `now`. */
static void admit(uint32_t slot, uint32_t len, int64_t now) {
    const unsigned char *p = slots + (size_t)slot * SLOT;
    c.packets++;
    c.bytes += len;
    if (len < 20 || len >= SLOT || (p[0] >> 4) != 4) { /* not the bed's IPv4, or cut short */
        c.other++;
        free_slots[nfree++] = slot;
        return;
    }
    uint32_t src, dst;
    memcpy(&src, p + 12, 4);
    memcpy(&dst, p + 16, 4);
    const struct host *a = &hosts[host_of(src)], *b = &hosts[host_of(dst)];
    double keep = (1 - a->loss) * (1 - b->loss);
    if (keep < 1 && uniform() >= keep) {
        c.drops++;
        free_slots[nfree++] = slot;
        return;
    }
    int64_t hold = a->delay_ns + b->delay_ns + jitter(a->jitter_ns) + jitter(b->jitter_ns);
    int64_t t = now + (hold > 0 ? hold : 0);
    int64_t *prev = &last[(size_t)(a - hosts) * cap_hosts + (size_t)(b - hosts)];
    if (t < *prev) t = *prev; /* a flow is never reordered */
    *prev = t;
    push((struct item){t, seq++, slot, len});
    c.queue_bytes += len;
    if (heap_n > c.queue_peak) c.queue_peak = heap_n;
    if (c.queue_bytes > c.queue_peak_bytes) c.queue_peak_bytes = c.queue_bytes;
}

static void release(int fd) {
    int64_t now = now_ns();
    while (heap_n && heap[0].t <= now) {
        struct item it = pop();
        if (write(fd, slots + (size_t)it.slot * SLOT, it.len) == (ssize_t)it.len)
            c.sent++;
        else
            c.write_errors++;
        uint64_t late = (uint64_t)(now - it.t);
        c.late_sum_ns += late;
        if (late > c.late_max_ns) c.late_max_ns = late;
        c.queue_bytes -= it.len;
        free_slots[nfree++] = it.slot;
    }
}

/* Read what is waiting, at most BATCH packets; 0 when the device is drained. */
static int receive(int fd) {
    static unsigned char scratch[SLOT];
    for (int n = 0; n < BATCH; n++) {
        uint32_t slot = nfree ? free_slots[nfree - 1] : UINT32_MAX;
        unsigned char *buf = slot == UINT32_MAX ? scratch : slots + (size_t)slot * SLOT;
        ssize_t len = read(fd, buf, SLOT);
        if (len < 0) {
            if (errno == EAGAIN || errno == EINTR) return 0;
            die("read");
        }
        if (slot == UINT32_MAX) { /* every slot holds a packet: the queue is full */
            c.packets++;
            c.bytes += (uint64_t)len;
            c.overflow++;
            continue;
        }
        nfree--;
        admit(slot, (uint32_t)len, now_ns());
    }
    return 1;
}

/* -- control ---------------------------------------------------------------------------- */
static int device = -1;

/* Take in what waits on the device (at most a full queue's worth: a device that never
 * drains is a flood, and the counters then say so anyway). */
static void drain(void) {
    for (uint32_t i = 0; i <= nslots / BATCH && receive(device); i++) {
    }
}

static void print_counters(const char *event) {
    printf("{\"event\": \"%s\", \"packets\": %llu, \"bytes\": %llu, \"sent\": %llu, "
           "\"drops\": %llu, \"overflow\": %llu, \"other\": %llu, \"write_errors\": %llu, "
           "\"queue\": %u, \"queue_peak\": %llu, \"queue_peak_bytes\": %llu, "
           "\"late_max_us\": %.1f, \"late_sum_us\": %.1f, \"hosts\": %u, \"slots\": %u}\n",
           event, (unsigned long long)c.packets, (unsigned long long)c.bytes,
           (unsigned long long)c.sent, (unsigned long long)c.drops,
           (unsigned long long)c.overflow, (unsigned long long)c.other,
           (unsigned long long)c.write_errors, heap_n, (unsigned long long)c.queue_peak,
           (unsigned long long)c.queue_peak_bytes, (double)c.late_max_ns / 1e3,
           (double)c.late_sum_ns / 1e3, nhosts - 1, nslots);
    fflush(stdout);
}

static void command(char *line) {
    char addr[64];
    double d, j, l;
    if (strcmp(line, "stats") == 0) {
        drain();
        print_counters("stats");
    } else if (strcmp(line, "reset") == 0) {
        drain();
        print_counters("stats");
        uint64_t queued = c.queue_bytes;
        memset(&c, 0, sizeof c);
        c.queue_peak = heap_n;
        c.queue_bytes = c.queue_peak_bytes = queued;
    } else if (sscanf(line, "host %63s %lf %lf %lf", addr, &d, &j, &l) == 4 &&
               set_host(addr, d, j, l) == 0) {
        printf("{\"event\": \"host\", \"addr\": \"%s\"}\n", addr);
        fflush(stdout);
    } else {
        printf("{\"event\": \"error\", \"line\": \"%.80s\"}\n", line);
        fflush(stdout);
    }
}

/* Run the complete lines waiting on stdin; 0 at its end. */
static int control(int fd) {
    static char buf[4096];
    static size_t have;
    ssize_t n = read(fd, buf + have, sizeof buf - 1 - have);
    if (n < 0) return errno == EAGAIN || errno == EINTR;
    if (n == 0) return 0;
    have += (size_t)n;
    buf[have] = 0;
    char *start = buf, *nl;
    while ((nl = memchr(start, '\n', have - (size_t)(start - buf)))) {
        *nl = 0;
        if (nl > start && nl[-1] == '\r') nl[-1] = 0;
        command(start);
        start = nl + 1;
    }
    have -= (size_t)(start - buf);
    memmove(buf, start, have);
    if (have == sizeof buf - 1) have = 0; /* a line that long is no command */
    return 1;
}

/* -- setup ------------------------------------------------------------------------------ */
static int open_tun(const char *name) {
    int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) die("/dev/net/tun");
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
    snprintf(ifr.ifr_name, IFNAMSIZ, "%s", name);
    if (ioctl(fd, TUNSETIFF, &ifr) < 0) die(name);
    return fd;
}

static void usage(void) {
    fprintf(stderr, "usage: linkem (--tun NAME | --fd N) [--host ADDR,DELAY_MS,JITTER_MS,LOSS]"
                    "... [--seed N] [--slots N] [--control]\n");
    exit(2);
}

static int parse_args(int argc, char **argv, int *control_on) {
    int fd = -1;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(arg, "--control") == 0) { *control_on = 1; continue; }
        if (!val) usage();
        i++;
        if (strcmp(arg, "--tun") == 0) {
            fd = open_tun(val);
        } else if (strcmp(arg, "--fd") == 0) {
            fd = atoi(val);
            if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) < 0) die("--fd");
        } else if (strcmp(arg, "--seed") == 0) {
            rng = strtoull(val, NULL, 10);
        } else if (strcmp(arg, "--slots") == 0) {
            nslots = (uint32_t)strtoul(val, NULL, 10);
        } else if (strcmp(arg, "--host") == 0) {
            char addr[64];
            double d, j, l;
            if (sscanf(val, "%63[^,],%lf,%lf,%lf", addr, &d, &j, &l) != 4 ||
                set_host(addr, d, j, l) != 0) {
                fprintf(stderr, "linkem: --host %s: want ADDR,DELAY_MS,JITTER_MS,LOSS\n", val);
                exit(2);
            }
        } else {
            usage();
        }
    }
    if (fd < 0 || nslots == 0) usage();
    return fd;
}

static int signals(void) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGUSR1);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    if (sigprocmask(SIG_BLOCK, &set, NULL) < 0) die("sigprocmask");
    int fd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
    if (fd < 0) die("signalfd");
    return fd;
}

/* 0 when the program is to end. */
static int on_signal(int fd) {
    struct signalfd_siginfo si;
    while (read(fd, &si, sizeof si) == sizeof si) {
        if (si.ssi_signo != SIGUSR1) return 0;
        drain();
        print_counters("stats");
    }
    return 1;
}

int main(int argc, char **argv) {
    int control_on = 0;
    rng = (uint64_t)now_ns() ^ ((uint64_t)getpid() << 32);
    nslots = 1 << 17;
    grow(1);
    hosts[0] = (struct host){0, 0, 0, 0};
    int fd = device = parse_args(argc, argv, &control_on), sfd = signals();
    /* Slots are touched only when used (the free list is a stack), so a large queue costs
     * memory only while it is full. */
    slots = malloc((size_t)nslots * SLOT);
    free_slots = malloc((size_t)nslots * sizeof *free_slots);
    heap = malloc((size_t)nslots * sizeof *heap);
    if (!slots || !free_slots || !heap) die("queue");
    for (uint32_t i = 0; i < nslots; i++) free_slots[i] = nslots - 1 - i;
    nfree = nslots;
    prctl(PR_SET_TIMERSLACK, 1UL); /* wake at the release time, not 50 us after it */
    if (control_on) fcntl(0, F_SETFL, fcntl(0, F_GETFL) | O_NONBLOCK);
    printf("{\"event\": \"ready\", \"hosts\": %u, \"slots\": %u}\n", nhosts - 1, nslots);
    fflush(stdout);
    struct pollfd fds[3] = {{fd, POLLIN, 0}, {sfd, POLLIN, 0}, {0, POLLIN, 0}};
    for (int busy = 0;;) {
        release(fd);
        struct timespec wait = {0, 0}, *timeout = NULL;
        if (!busy && heap_n) {
            int64_t ns = heap[0].t - now_ns();
            if (ns > 0) wait = (struct timespec){ns / 1000000000, ns % 1000000000};
            timeout = &wait;
        } else if (busy) {
            timeout = &wait;
        }
        if (ppoll(fds, control_on ? 3 : 2, timeout, NULL) < 0 && errno != EINTR) die("ppoll");
        if (fds[0].revents & (POLLERR | POLLNVAL)) die("device");
        if ((fds[0].revents & POLLHUP) && !(fds[0].revents & POLLIN)) break; /* --fd: peer gone */
        busy = (fds[0].revents & POLLIN) ? receive(fd) : 0;
        if ((fds[1].revents & POLLIN) && !on_signal(sfd)) break;
        if (control_on && (fds[2].revents & (POLLIN | POLLHUP)) && !control(0)) break;
    }
    print_counters("exit");
    return 0;
}
