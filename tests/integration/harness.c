/*
 * harness.c: daemon spawning, raw HTTP, the CPU reference and comparisons for the integration
 * tests (see harness.h).
 */
#include "harness.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <arpa/inet.h>
#include <time.h>
#include <unistd.h>

#ifndef RNND_BIN
#define RNND_BIN "rnnd"
#endif
#ifndef RNNDCTL_BIN
#define RNNDCTL_BIN "rnndctl"
#endif

double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR)
        ;
}

const char *rnnd_bin(void) {
    const char *e = getenv("RNND_BIN");
    return e && *e ? e : RNND_BIN;
}

const char *harness_backend(void) {
    const char *e = getenv("RNND_BACKEND");
    return e && *e ? e : "cpu";
}

const char *harness_compute(void) {
    const char *e = getenv("RNND_COMPUTE");
    return e && *e ? e : "fp32";
}

const char *harness_devices(void) {
    const char *e = getenv("RNND_DEVICES");
    return e && *e ? e : NULL;
}

const char *rnndctl_bin(void) {
    const char *e = getenv("RNNDCTL_BIN");
    return e && *e ? e : RNNDCTL_BIN;
}

// ---------------------------------------------------------------------------------------------
// The daemon.

static bool state_owned[64];
static char owned_dirs[64][256];

static void mark_owned(const char *dir, bool owned) {
    for (int k = 0; k < 64; k++) {
        if (owned_dirs[k][0] == '\0' || strcmp(owned_dirs[k], dir) == 0) {
            snprintf(owned_dirs[k], sizeof owned_dirs[k], "%s", dir);
            state_owned[k] = state_owned[k] || owned;
            return;
        }
    }
}

static bool is_owned(const char *dir) {
    for (int k = 0; k < 64; k++)
        if (strcmp(owned_dirs[k], dir) == 0)
            return state_owned[k];
    return false;
}

char *read_file(const char *path, size_t *len) {
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return NULL;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap + 1);
    for (;;) {
        if (n == cap) {
            cap *= 2;
            buf = realloc(buf, cap + 1);
        }
        ssize_t r = read(fd, buf + n, cap - n);
        if (r <= 0)
            break;
        n += (size_t)r;
    }
    close(fd);
    buf[n] = '\0';
    if (len)
        *len = n;
    return buf;
}

void daemon_teardown(struct daemon *d) {
    if (!daemon_alive(d) && d->exit_status != 0) {
        fprintf(stderr, "rnnd died during the tests (status 0x%x)\n", d->exit_status);
        daemon_dump_log(d, 4000);
    }
    daemon_free(d);
}

void daemon_dump_log(const struct daemon *d, size_t n) {
    size_t len;
    char *log = read_file(d->log_path, &len);
    if (!log) {
        fprintf(stderr, "(no log at %s)\n", d->log_path);
        return;
    }
    const char *p = len > n ? log + len - n : log;
    fprintf(stderr, "---- %s (last %zu bytes) ----\n%s\n---- end of log ----\n", d->log_path,
            (size_t)(log + len - p), p);
    free(log);
}

// A socket's line in the daemon's /proc/PID/net/tcp{,6}: local and remote address:port in hex and
// the state (01 established, 08 close-wait, 0a listen), to name which connection a leaked
// descriptor is and whether its peer has gone.
static void tcp_show(pid_t pid, const char *target) {
    unsigned long ino;
    if (sscanf(target, "socket:[%lu]", &ino) != 1)
        return;
    for (int v6 = 0; v6 < 2; v6++) {
        char path[64], line[512];
        snprintf(path, sizeof path, "/proc/%d/net/tcp%s", (int)pid, v6 ? "6" : "");
        FILE *f = fopen(path, "r");
        while (f && fgets(line, sizeof line, f)) {
            char local[64], remote[64];
            unsigned st;
            unsigned long i;
            if (sscanf(line, " %*d: %63s %63s %x %*s %*s %*s %*s %*s %lu", local, remote, &st,
                       &i) == 4 &&
                i == ino)
                fprintf(stderr, "    tcp%s %s -> %s state %02x\n", v6 ? "6" : "", local, remote,
                        st);
        }
        if (f)
            fclose(f);
    }
}

int daemon_fd_count(const struct daemon *d, bool show) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd", (int)d->pid);
    DIR *dp = opendir(path);
    if (!dp)
        return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(dp))) {
        if (e->d_name[0] == '.')
            continue;
        n++;
        if (show) {
            char link[320], target[256];
            snprintf(link, sizeof link, "%s/%s", path, e->d_name);
            ssize_t k = readlink(link, target, sizeof target - 1);
            target[k > 0 ? k : 0] = '\0';
            fprintf(stderr, "  fd %s -> %s\n", e->d_name, target);
            tcp_show(d->pid, target);
        }
    }
    closedir(dp);
    return n;
}

int daemon_fds_settle(const struct daemon *d, int before) {
    int n = daemon_fd_count(d, false);
    for (double t0 = now_seconds(); n > before && now_seconds() - t0 < 5;) {
        sleep_ms(100);
        n = daemon_fd_count(d, false);
    }
    if (n > before)
        daemon_fd_count(d, true);
    return n;
}

static bool word_after(const char *line, const char *key, char *out, size_t n) {
    const char *p = strstr(line, key);
    if (!p)
        return false;
    p += strlen(key);
    size_t k = strcspn(p, " \t\r\n");
    if (k == 0 || k >= n)
        return false;
    memcpy(out, p, k);
    out[k] = '\0';
    return true;
}

int daemon_spawn_in(struct daemon *d, const char *state_dir, bool owned, const char *const *args) {
    memset(d, 0, sizeof *d);
    snprintf(d->state_dir, sizeof d->state_dir, "%s", state_dir);
    mark_owned(d->state_dir, owned);
    snprintf(d->log_path, sizeof d->log_path, "%s/rnnd.log", d->state_dir);

    const char *argv[96];
    int n = 0;
    argv[n++] = rnnd_bin();
    argv[n++] = "--backend";
    argv[n++] = harness_backend();
    argv[n++] = "--compute";
    argv[n++] = harness_compute();
    argv[n++] = "--listen";
    argv[n++] = "127.0.0.1:0";
    argv[n++] = "--http";
    argv[n++] = "127.0.0.1:0";
    argv[n++] = "--state-dir";
    argv[n++] = d->state_dir;
    if (harness_devices()) {
        argv[n++] = "--devices";
        argv[n++] = harness_devices();
    }
    const char *lookahead = getenv("RNND_STEP_LOOKAHEAD");
    if (lookahead && *lookahead) {
        // The engine thread alone takes the batches, so that chains of them form, with row
        // workers (none by default under 8 CPUs) that finish one batch while it admits the next.
        argv[n++] = "--step-lookahead";
        argv[n++] = lookahead;
        argv[n++] = "--inline-steps";
        argv[n++] = "0";
        argv[n++] = "--reply-threads";
        argv[n++] = "2";
    }
    for (int k = 0; args && args[k] && n < 95; k++)
        argv[n++] = args[k];
    argv[n] = NULL;

    size_t log_start = 0;
    struct stat st;
    if (stat(d->log_path, &st) == 0)
        log_start = (size_t)st.st_size;
    double t0 = now_seconds();
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        // Dies with the test process, so a crashed test leaves no daemon behind.
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(127);
        int fd = open(d->log_path, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        int devnull = open("/dev/null", O_RDONLY);
        if (devnull >= 0) {
            dup2(devnull, 0);
            close(devnull);
        }
        execv(argv[0], (char *const *)argv);
        fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    d->pid = pid;
    d->log_start = log_start;
    d->spawn_seconds = t0;
    return 0;
}

int daemon_wait_ready(struct daemon *d, double timeout_s) {
    double t0 = d->spawn_seconds;
    pid_t pid = d->pid;
    size_t log_start = d->log_start;
    // A restart in the same directory appends to the log: only text after this start's offset
    // counts, and the ready line may follow other log lines.
    while (now_seconds() - t0 < timeout_s) {
        size_t len;
        char *log = read_file(d->log_path, &len);
        const char *from = log && len >= log_start ? log + log_start : log;
        const char *last = from ? strstr(from, "rnnd ready ") : NULL;
        if (last) {
            size_t k = strcspn(last, "\n");
            if (last[k] == '\n') {
                snprintf(d->ready_line, sizeof d->ready_line, "%.*s", (int)k, last);
                bool ok = word_after(d->ready_line, "grpc=", d->grpc, sizeof d->grpc) &&
                          word_after(d->ready_line, "http=", d->http, sizeof d->http);
                word_after(d->ready_line, "backend=", d->backend, sizeof d->backend);
                free(log);
                if (!ok) {
                    fprintf(stderr, "cannot parse the ready line: %s\n", d->ready_line);
                    daemon_free(d);
                    return -1;
                }
                d->start_seconds = now_seconds() - t0;
                return 0;
            }
        }
        free(log);
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) {
            d->pid = 0;
            d->exit_status = status;
            fprintf(stderr, "rnnd exited before it was ready (status 0x%x)\n", status);
            daemon_dump_log(d, 4000);
            daemon_free(d); // no teardown runs after a failed setup
            return -1;
        }
        sleep_ms(5);
    }
    fprintf(stderr, "rnnd not ready after %.0f s\n", timeout_s);
    daemon_dump_log(d, 4000);
    daemon_free(d);
    return -1;
}

int daemon_start_in(struct daemon *d, const char *state_dir, bool owned, const char *const *args) {
    if (daemon_spawn_in(d, state_dir, owned, args) != 0)
        return -1;
    return daemon_wait_ready(d, 30.0);
}

int daemon_spawn(struct daemon *d, const char *const *args) {
    char dir[] = "/tmp/rnnd-it-XXXXXX";
    if (!mkdtemp(dir)) {
        fprintf(stderr, "mkdtemp: %s\n", strerror(errno));
        return -1;
    }
    return daemon_spawn_in(d, dir, true, args);
}

bool daemon_log_contains(const struct daemon *d, const char *needle) {
    size_t len;
    char *log = read_file(d->log_path, &len);
    bool found = log && len >= d->log_start && strstr(log + d->log_start, needle) != NULL;
    free(log);
    return found;
}

int daemon_start(struct daemon *d, const char *const *args) {
    char dir[] = "/tmp/rnnd-it-XXXXXX";
    if (!mkdtemp(dir)) {
        fprintf(stderr, "mkdtemp: %s\n", strerror(errno));
        return -1;
    }
    // A fresh log per daemon even when a test restarts into the same directory later.
    return daemon_start_in(d, dir, true, args);
}

bool daemon_alive(struct daemon *d) {
    if (d->pid <= 0)
        return false;
    int status;
    if (waitpid(d->pid, &status, WNOHANG) == d->pid) {
        d->pid = 0;
        d->exit_status = status;
        return false;
    }
    return true;
}

int daemon_signal_wait(struct daemon *d, int sig, int timeout_ms) {
    if (d->pid <= 0)
        return 0;
    kill(d->pid, sig);
    double t0 = now_seconds();
    while ((now_seconds() - t0) * 1000.0 < timeout_ms) {
        if (!daemon_alive(d))
            return 0;
        sleep_ms(5);
    }
    return -1;
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb;
    (void)flag;
    (void)ftw;
    remove(path);
    return 0;
}

void daemon_free(struct daemon *d) {
    if (d->pid > 0) {
        kill(d->pid, SIGKILL);
        int status;
        waitpid(d->pid, &status, 0);
        d->pid = 0;
        d->exit_status = status;
    }
    const char *keep = getenv("RNND_TEST_KEEP");
    if (d->state_dir[0] && is_owned(d->state_dir) && !(keep && *keep && strcmp(keep, "0") != 0))
        nftw(d->state_dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

struct rnnd_client *daemon_client(const struct daemon *d, const char *token) {
    struct rnnd_client_opts o = {.target = d->grpc, .token = token, .timeout_ms = 20000};
    struct rnnd_client *c = NULL;
    int err = rnnd_client_init(&o, &c);
    if (err)
        fprintf(stderr, "client init: %s\n", rnnd_client_last_error()->message);
    assert_int_equal(err, 0);
    return c;
}

int run_capture(const char *const *argv, int timeout_ms, char **out) {
    int fds[2];
    *out = NULL;
    if (pipe(fds) != 0)
        return -1;
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        close(fds[1]);
        execv(argv[0], (char *const *)argv);
        fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    close(fds[1]);
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap + 1);
    double t0 = now_seconds();
    bool timed_out = false;
    for (;;) {
        int left = timeout_ms - (int)((now_seconds() - t0) * 1000.0);
        if (left <= 0) {
            timed_out = true;
            break;
        }
        struct pollfd p = {.fd = fds[0], .events = POLLIN};
        int pr = poll(&p, 1, left);
        if (pr < 0 && errno == EINTR)
            continue;
        if (pr <= 0) {
            timed_out = pr == 0;
            break;
        }
        if (n == cap) {
            cap *= 2;
            buf = realloc(buf, cap + 1);
        }
        ssize_t r = read(fds[0], buf + n, cap - n);
        if (r <= 0)
            break;
        n += (size_t)r;
    }
    close(fds[0]);
    buf[n] = '\0';
    *out = buf;
    if (timed_out)
        kill(pid, SIGKILL);
    int status;
    waitpid(pid, &status, 0);
    if (timed_out)
        return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// ---------------------------------------------------------------------------------------------
// HTTP.

static void dechunk(char *body) {
    char *src = body, *dst = body;
    for (;;) {
        char *end;
        unsigned long len = strtoul(src, &end, 16);
        char *nl = strstr(end, "\r\n");
        if (!nl || len == 0)
            break;
        src = nl + 2;
        size_t have = strlen(src);
        if (len > have)
            len = have;
        memmove(dst, src, len);
        dst += len;
        src += len;
        if (strncmp(src, "\r\n", 2) == 0)
            src += 2;
    }
    *dst = '\0';
}

int tcp_connect(const char *hostport) {
    char host[64];
    snprintf(host, sizeof host, "%s", hostport);
    char *colon = strrchr(host, ':');
    if (!colon)
        return -1;
    *colon = '\0';
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1)
        return -1;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

int http_raw(const char *hostport, const char *request, size_t len, int timeout_ms, int *status,
             char **headers, char **body) {
    *status = 0;
    *body = NULL;
    if (headers)
        *headers = NULL;
    int fd = tcp_connect(hostport);
    if (fd < 0)
        return -1;
    struct timeval tv = {timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    // The server may answer (and close) before it has read everything: a short write is fine.
    for (size_t off = 0; off < len;) {
        ssize_t w = write(fd, request + off, len - off);
        if (w <= 0)
            break;
        off += (size_t)w;
    }
    size_t cap = 8192, n = 0;
    char *buf = malloc(cap + 1);
    for (;;) {
        if (n == cap) {
            cap *= 2;
            buf = realloc(buf, cap + 1);
        }
        ssize_t r = read(fd, buf + n, cap - n);
        if (r <= 0)
            break;
        n += (size_t)r;
        buf[n] = '\0';
        // Stop at Content-Length without waiting for the close, when the server keeps it open.
        char *hend = strstr(buf, "\r\n\r\n");
        if (hend) {
            const char *cl = strcasestr(buf, "\r\ncontent-length:");
            if (cl && cl < hend) {
                size_t want = (size_t)strtoul(cl + 17, NULL, 10);
                if (n >= (size_t)(hend + 4 - buf) + want)
                    break;
            }
        }
    }
    close(fd);
    buf[n] = '\0';
    if (sscanf(buf, "HTTP/1.%*d %d", status) != 1) {
        free(buf);
        return -1;
    }
    char *hend = strstr(buf, "\r\n\r\n");
    if (!hend) {
        free(buf);
        return -1;
    }
    *hend = '\0';
    bool chunked = strcasestr(buf, "transfer-encoding: chunked") != NULL;
    if (headers)
        *headers = strdup(buf);
    *body = strdup(hend + 4);
    if (chunked)
        dechunk(*body);
    free(buf);
    return 0;
}

int http_get(const char *hostport, const char *path, int *status, char **headers, char **body) {
    char req[512];
    int len = snprintf(req, sizeof req,
                       "GET %s HTTP/1.1\r\nHost: %s\r\nUser-Agent: rnnd-integration-test\r\n"
                       "Accept: */*\r\nConnection: close\r\n\r\n",
                       path, hostport);
    return http_raw(hostport, req, (size_t)len, 5000, status, headers, body);
}

double daemon_metric(const struct daemon *d, const char *name, const char *labels) {
    int status;
    char *body = NULL;
    double v = NAN;
    if (http_get(d->http, "/metrics", &status, NULL, &body) == 0 && status == 200)
        v = prom_value(body, name, labels);
    free(body);
    return v;
}

double prom_value(const char *body, const char *name, const char *labels) {
    size_t nl = strlen(name);
    for (const char *line = body; line && *line;) {
        const char *eol = strchr(line, '\n');
        size_t len = eol ? (size_t)(eol - line) : strlen(line);
        if (line[0] != '#' && len > nl && strncmp(line, name, nl) == 0 &&
            (line[nl] == '{' || line[nl] == ' ')) {
            char sample[2048];
            snprintf(sample, sizeof sample, "%.*s", (int)len, line);
            const char *lab_end = line[nl] == '{' ? strchr(sample, '}') : sample + nl;
            bool match = true;
            if (labels && *labels) {
                char want[512];
                snprintf(want, sizeof want, "%s", labels);
                for (char *save, *tok = strtok_r(want, ";", &save); tok && match;
                     tok = strtok_r(NULL, ";", &save)) {
                    const char *hit = strstr(sample, tok);
                    match = hit && lab_end && hit < lab_end;
                }
            }
            if (match && lab_end) {
                const char *v = lab_end + (line[nl] == '{' ? 1 : 0);
                return strtod(v, NULL);
            }
        }
        line = eol ? eol + 1 : NULL;
    }
    return NAN;
}

// ---------------------------------------------------------------------------------------------
// Requests.

struct rnnd_step_req step_request(int B, const uint64_t *ids, float *x, int I, const bool *init) {
    return (struct rnnd_step_req){.n_env_ids = (size_t)B,
                                  .env_ids = ids,
                                  .obs = rnnd_tensor_f32(x, 2, B, I, 0, 0),
                                  .n_is_init = init ? (size_t)B : 0,
                                  .is_init = init};
}

int stream_step1(struct rnnd_client_stream *s, uint64_t id, float *x, int I, bool init) {
    struct rnnd_step_req req = step_request(1, &id, x, I, &init);
    struct rnnd_step_reply r;
    int err = rnnd_client_stream_step(s, &req, &r);
    rnnd_step_reply_free(&r);
    return err;
}

// ---------------------------------------------------------------------------------------------
// The reference.

void ref_init(struct ref *r, struct rnnd_client *c, int S) {
    memset(r, 0, sizeof *r);
    struct rnnd_model_info info;
    EXPECT_OK(rnnd_client_info(c, &info));
    assert_int_equal(rnnd_model_info_to_model(&info, &r->m), 0);
    r->extras_size = (int)info.extras_size;
    assert_int_equal(rnnd_backend_cpu_init(&r->be), 0);
    r->P = rnnd_model_param_count(&r->m);
    r->params = malloc(r->P * sizeof(float));
    r->S = S;
    size_t n = (size_t)S * (size_t)r->m.L * (size_t)r->m.H;
    r->state_h = calloc(n ? n : 1, sizeof(float));
    r->state_c = r->m.cell == RNND_CELL_LSTM ? calloc(n ? n : 1, sizeof(float)) : NULL;
    ref_reload(r, c);
}

void ref_reload(struct ref *r, struct rnnd_client *c) {
    struct rnnd_named_tensors w;
    EXPECT_OK(rnnd_client_get_weights(c, &w, NULL));
    int err = rnnd_named_tensors_to_params(&w, &r->m, r->params);
    if (err)
        fprintf(stderr, "weights: %s\n", rnnd_client_last_error()->message);
    assert_int_equal(err, 0);
    rnnd_named_tensors_free(&w);
}

void ref_free(struct ref *r) {
    free(r->params);
    free(r->state_h);
    free(r->state_c);
    rnnd_backend_free(&r->be);
    memset(r, 0, sizeof *r);
}

void ref_step(struct ref *r, int B, const int32_t *slots, const float *x, const bool *is_init,
              float *out) {
    // The backend writes new states to other rows (struct rnnd_step): rows S + b of a copy of the
    // table, copied back to the rows' slots after the step.
    size_t LH = (size_t)r->m.L * (size_t)r->m.H, tab = (size_t)r->S * LH;
    bool lstm = r->state_c != NULL;
    float *th = malloc((tab + (size_t)B * LH) * sizeof(float));
    float *tc = lstm ? malloc((tab + (size_t)B * LH) * sizeof(float)) : NULL;
    int32_t *rows_new = malloc((size_t)B * sizeof(int32_t));
    uint8_t *init = calloc((size_t)B, 1);
    assert_true(th && (tc || !lstm) && rows_new && init);
    memcpy(th, r->state_h, tab * sizeof(float));
    if (lstm)
        memcpy(tc, r->state_c, tab * sizeof(float));
    for (int b = 0; b < B; b++) {
        rows_new[b] = r->S + b;
        // A slot past the reference's table would write over whatever follows it (wrong
        // references, heap corruption or a hang, depending on the heap): a test bug, said here.
        if (slots[b] < 0 || slots[b] >= r->S)
            fprintf(stderr, "ref_step: row %d uses slot %d; ref_init gave %d slots\n", b, slots[b],
                    r->S);
        assert_true(slots[b] >= 0 && slots[b] < r->S);
        init[b] = is_init ? is_init[b] : 0;
    }
    struct rnnd_step st = {
        .B = B,
        .x = x,
        .is_init = init,
        .slots = slots,
        .slots_new = rows_new,
        .state_h = th,
        .state_c = tc,
        .out = out,
    };
    assert_int_equal(r->be.ops->rnn_step(r->be.ctx, &st, r->params, &r->m), 0);
    for (int b = 0; b < B; b++) {
        memcpy(r->state_h + (size_t)slots[b] * LH, th + (size_t)rows_new[b] * LH,
               LH * sizeof(float));
        if (lstm)
            memcpy(r->state_c + (size_t)slots[b] * LH, tc + (size_t)rows_new[b] * LH,
                   LH * sizeof(float));
    }
    free(th);
    free(tc);
    free(rows_new);
    free(init);
}

// ---------------------------------------------------------------------------------------------
// Helpers.

float rng_f(struct rng *g) {
    g->s ^= g->s >> 12;
    g->s ^= g->s << 25;
    g->s ^= g->s >> 27;
    uint64_t v = g->s * 2685821657736338717ull;
    return (float)((double)(v >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

uint32_t rng_u(struct rng *g, uint32_t n) {
    float f = (rng_f(g) + 1.0f) * 0.5f;
    uint32_t k = (uint32_t)(f * (float)n);
    return k >= n ? n - 1 : k;
}

void rng_perm(struct rng *g, int *perm, int n) {
    for (int k = 0; k < n; k++)
        perm[k] = k;
    for (int k = n - 1; k > 0; k--) { // Fisher-Yates
        int j = (int)rng_u(g, (uint32_t)k + 1);
        int t = perm[k];
        perm[k] = perm[j];
        perm[j] = t;
    }
}

void rng_fill(struct rng *g, float *v, size_t n) {
    for (size_t k = 0; k < n; k++)
        v[k] = rng_f(g);
}

bool close_f32(const char *what, const float *a, const float *b, size_t n, float atol, float rtol) {
    if (!a || !b) {
        fprintf(stderr, "%s: %s is missing\n", what, !a ? "the value" : "the reference");
        return false;
    }
    size_t bad = 0;
    for (size_t k = 0; k < n; k++) {
        float d = fabsf(a[k] - b[k]);
        if (!(d <= atol + rtol * fabsf(b[k]))) {
            if (bad < 5)
                fprintf(stderr, "%s: mismatch at [%zu]: got %.9g, want %.9g (|d| = %.3g)\n", what,
                        k, (double)a[k], (double)b[k], (double)d);
            bad++;
        }
    }
    if (bad)
        fprintf(stderr, "%s: %zu of %zu values differ (atol %g rtol %g)\n", what, bad, n,
                (double)atol, (double)rtol);
    return bad == 0;
}

double max_abs_diff(const float *a, const float *b, size_t n) {
    double m = 0;
    for (size_t k = 0; k < n; k++) {
        double d = fabs((double)a[k] - (double)b[k]);
        if (!(d <= m))
            m = d;
    }
    return m;
}

void assert_tensor_f32(const struct rnnd_tensor *t, int ndim, int64_t d0, int64_t d1, int64_t d2,
                       int64_t d3) {
    int64_t want[4] = {d0, d1, d2, d3};
    bool ok = t->present && t->dtype == RNND_DTYPE_FLOAT32 && t->ndim == ndim;
    for (int d = 0; ok && d < ndim; d++)
        ok = t->shape[d] == want[d];
    if (ok)
        ok = t->nbytes == (size_t)rnnd_tensor_numel(t) * 4;
    if (!ok) {
        fprintf(stderr, "tensor: present %d dtype %s ndim %d shape [", t->present,
                rnnd_dtype_name(t->dtype), t->ndim);
        for (int d = 0; d < t->ndim; d++)
            fprintf(stderr, "%s%lld", d ? ", " : "", (long long)t->shape[d]);
        fprintf(stderr, "] bytes %zu; wanted float32 ndim %d [%lld, %lld, %lld, %lld]\n", t->nbytes,
                ndim, (long long)d0, (long long)d1, (long long)d2, (long long)d3);
    }
    assert_true(ok);
}

void expect_status_(int err, int status, const char *expr, const char *file, int line) {
    const struct rnnd_client_error *e = rnnd_client_last_error();
    if (err == 0 || e->grpc_status != status) {
        fprintf(stderr, "%s:%d: %s: wanted %s, got %s (%s): %s\n", file, line, expr,
                rnnd_grpc_status_name(status),
                err == 0 ? "OK" : rnnd_grpc_status_name(e->grpc_status), rnnd_err_name(err),
                err == 0 ? "" : e->message);
        _fail(file, line);
    }
    if (getenv("RNND_TEST_VERBOSE"))
        fprintf(stderr, "  %s -> %s: %s\n", expr, rnnd_grpc_status_name(status), e->message);
}

void expect_ok_(int err, const char *expr, const char *file, int line) {
    if (err != 0) {
        const struct rnnd_client_error *e = rnnd_client_last_error();
        fprintf(stderr, "%s:%d: %s failed: %s (%s, grpc %s): %s\n", file, line, expr,
                rnnd_strerror(err), rnnd_err_name(err), rnnd_grpc_status_name(e->grpc_status),
                e->message);
        _fail(file, line);
    }
}
