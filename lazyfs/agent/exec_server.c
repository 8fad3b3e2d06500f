/* The exec server: runs INSIDE a sandbox, as its PID 1 (nothing in front of it), so that
 * a command starts with one fork+exec instead of a `runc exec` (which starts a Go binary
 * and joins the namespaces each time: 10-30 ms here).
 *
 * Why C and not Python: one runs in every sandbox, for the sandbox's whole life. A
 * Python server costs 8.5-12 MB of RSS per sandbox and a python3 in the image, started
 * cold from the lazily fetched tree (0.2 s on a cold create); this one is a static
 * binary bind-mounted from the host (/dev/lazyfs-exec), a few hundred KB resident, and
 * works in any image.
 *
 * Why the sandbox's code cannot reach it or forge what it reports (issue 20, finding 6):
 * - Its listening socket is made by the agent on the host, in a directory mounted nowhere
 *   in the sandbox, and handed over as fd 3 (`runc run --preserve-fds 1`): no path in the
 *   sandbox leads to it. The agent keeps no copy, so once this process is gone a connect
 *   is refused at once (and the agent falls back to `runc exec`, saying so).
 * - It is PID 1 of the sandbox's PID namespace: the kernel delivers no signal from inside
 *   the namespace that PID 1 has no handler for, SIGKILL and SIGSTOP included, so the
 *   sandbox's code (even as root) cannot kill or stop it; it installs no handler. (With
 *   tini in front, tini would hold fd 3, dumpable, and the server could be killed.)
 * - It makes itself non-dumpable first thing: then sandbox root, which lacks
 *   CAP_SYS_PTRACE, cannot ptrace it, read its /proc/1/{mem,environ,maps}, open or
 *   readlink /proc/1/fd/N (root can still list the numbers) or take fd 3 with
 *   pidfd_getfd (the seccomp profile refuses that call too). That also keeps its stdout
 *   and stderr, the bundle's log file on the host, out of reach. The process it forks
 *   per connection inherits it; the command's execve makes the command an ordinary
 *   (dumpable) process again. fd 3 and each connection are close-on-exec.
 * What is left to the sandbox: killing the per-connection process that serves a command
 * (the agent then answers 502, never a result), and everything a command's own code does.
 *
 * As PID 1 it also reaps: SIGCHLD is ignored, so the kernel reaps every child, and every
 * orphan re-parented to it, as it exits (a command that daemonized, `kill -9 -1`).
 *
 * Every command it starts inherits what PID 1 has: the sandbox's user, capabilities,
 * seccomp filter, cgroup and namespaces, exactly as `runc exec` would give them; less
 * the capabilities a request drops (a sandbox asked with cap_drop: every agent sandbox
 * is made with the default ones, so that a command's user can still change), from
 * every set, the bounding one first, before the user changes, and the rest after it;
 * and with the resource limits a request sets (a sandbox asked with ulimits: setrlimit,
 * which may lower a hard limit or raise a soft one up to it, never raise a hard one).
 *
 * Protocol (docs/FORMATS.md, "exec protocol", version 5), one connection per command,
 * on the listening unix socket it finds at fd 3:
 *   agent -> server: u32 header length H, u32 argc, u32 stdin word (big-endian):
 *                    its low 27 bits the stdin length N, bit 31 "stdin streamed", bit
 *                    30 "a terminal", bit 29 "as a user", bit 28 "drops capabilities",
 *                    bit 27 "sets limits"; then H bytes of NUL-terminated strings:
 *                    ("RESOURCE:SOFT:HARD,..." if it sets limits, decimal, -1 for
 *                    unlimited), (the capabilities to drop, a hex mask by number, if it
 *                    drops some), ("UID:GID:G1,G2..." if as a user), cwd,
 *                    argv[0..argc), env...; then N bytes of stdin.
 *                    Streamed: frames of
 *                    u8 kind (0 stdin, length 0 its end; 5 a terminal's size, u16 rows,
 *                    u16 columns), u32 length, bytes, for as long as the command runs
 *   server -> agent: frames of u8 kind (1 stdout, 2 stderr, 3 exit, 4 pid), u32 length,
 *                    bytes; the pid frame (first, once the command started) is its PID
 *                    in the sandbox; the exit frame's 4 bytes are the exit status
 *                    (128+N: signal N)
 *   the agent closing its end: the command's whole process group is killed.
 *
 * Built by scripts/setup.sh: cc -O2 -static -o .venv/bin/lazyfs-exec-server this file.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <termios.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/capability.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <grp.h>
#include <time.h>
#include <unistd.h>

enum { STDOUT_FRAME = 1, STDERR_FRAME = 2, EXIT_FRAME = 3, PID_FRAME = 4 };
enum { STDIN_FRAME = 0, RESIZE_FRAME = 5 }; /* agent -> server, when stdin is streamed */
#define STREAMED (1u << 31)                  /* in the stdin word: stdin comes as frames */
#define TERMINAL (1u << 30)                  /* in the stdin word: run on a pseudo-terminal */
#define AS_USER (1u << 29)                   /* in the stdin word: the header names a user */
#define DROPS_CAPS (1u << 28)                /* in the stdin word: the header drops capabilities */
#define SETS_LIMITS (1u << 27)               /* in the stdin word: the header sets rlimits */
#define LENGTH_BITS 0x07ffffffu
#define MAX_GROUPS 64
#define MAX_LIMITS 16 /* RLIMIT_NLIMITS */
#define EOT 4 /* ^D: a terminal's end of input (closing the master would hang it up) */
enum { STEP_SETUP, STEP_CWD, STEP_EXEC }; /* where a command failed to start */
#define MAX_HEADER (16u << 20) /* argv + env: the kernel's own limit is far below */
#define MAX_STDIN LENGTH_BITS /* 128 MiB - 1; the agent's API bounds it lower */
#define FRAME 65536
#define DRAIN_MS 1000 /* a background child may keep the pipes open: do not wait for it */
#define LISTENER 3     /* the listening socket the agent hands over */

extern char **environ;

static int read_exact(int fd, void *buf, size_t n) {
    char *p = buf;
    while (n > 0) {
        ssize_t got = read(fd, p, n);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            return -1;
        p += got;
        n -= (size_t)got;
    }
    return 0;
}

static int write_all(int fd, const void *buf, size_t n) {
    const char *p = buf;
    while (n > 0) {
        ssize_t put = send(fd, p, n, MSG_NOSIGNAL);
        if (put < 0 && errno == EINTR)
            continue;
        if (put < 0)
            return -1;
        p += put;
        n -= (size_t)put;
    }
    return 0;
}

static int send_frame(int conn, int kind, const void *data, uint32_t size) {
    unsigned char head[5] = {(unsigned char)kind, size >> 24, size >> 16, size >> 8, size};
    return write_all(conn, head, sizeof head) || write_all(conn, data, size) ? -1 : 0;
}

static void send_int(int conn, int kind, int value) {
    unsigned char body[4] = {value >> 24, value >> 16, value >> 8, value};
    send_frame(conn, kind, body, sizeof body);
}

static void send_exit(int conn, int code) { send_int(conn, EXIT_FRAME, code); }

static uint32_t be32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

struct request {
    char *cwd;
    char **argv; /* NULL-terminated */
    char **env;  /* NULL-terminated */
    char *stdin_data;
    size_t stdin_size;
    int streamed; /* stdin comes as frames while the command runs */
    int terminal; /* the command's stdin, stdout and stderr are a pseudo-terminal */
    int as_user;  /* the command runs as uid, gid, groups (the server's user otherwise) */
    uint64_t drop_caps; /* capabilities (bit N: capability N) the command does not get */
    struct {
        int resource;
        struct rlimit value;
    } limits[MAX_LIMITS]; /* set on the command before it starts */
    size_t nlimits;
    uid_t uid;
    gid_t gid;
    gid_t groups[MAX_GROUPS];
    size_t ngroups;
};

/* One limit's value: decimal, -1 for unlimited. */
static int parse_rlim(const char *p, char **end, rlim_t *out) {
    errno = 0;
    long long value = strtoll(p, end, 10);
    if (*end == p || errno || value < -1)
        return -1;
    *out = value == -1 ? RLIM_INFINITY : (rlim_t)value;
    return 0;
}

/* "RESOURCE:SOFT:HARD,..." (at least one): 0, or -1 if it is not that. */
static int parse_limits(const char *spec, struct request *req) {
    const char *p = spec;
    req->nlimits = 0;
    for (;;) {
        char *end;
        unsigned long resource = strtoul(p, &end, 10);
        if (end == p || *end != ':' || resource >= MAX_LIMITS || req->nlimits == MAX_LIMITS)
            return -1;
        struct rlimit value;
        if (parse_rlim(end + 1, &end, &value.rlim_cur) || *end != ':' ||
            parse_rlim(end + 1, &end, &value.rlim_max) || (*end != ',' && *end != '\0'))
            return -1;
        req->limits[req->nlimits].resource = (int)resource;
        req->limits[req->nlimits].value = value;
        req->nlimits++;
        if (*end == '\0')
            return 0;
        p = end + 1;
    }
}

/* "UID:GID:G1,G2,..." (the groups may be empty): 0, or -1 if it is not that. */
static int parse_user(const char *spec, struct request *req) {
    char *end;
    unsigned long uid = strtoul(spec, &end, 10);
    if (end == spec || *end != ':')
        return -1;
    const char *p = end + 1;
    unsigned long gid = strtoul(p, &end, 10);
    if (end == p || *end != ':' || uid > 0x7fffffff || gid > 0x7fffffff)
        return -1;
    req->uid = (uid_t)uid;
    req->gid = (gid_t)gid;
    req->ngroups = 0;
    p = end + 1;
    while (*p) {
        unsigned long group = strtoul(p, &end, 10);
        if (end == p || group > 0x7fffffff || req->ngroups == MAX_GROUPS ||
            (*end != ',' && *end != '\0'))
            return -1;
        req->groups[req->ngroups++] = (gid_t)group;
        p = *end ? end + 1 : end;
    }
    return 0;
}

/* Past the header's first string, a flag's (read by the caller). */
static void skip_string(char **header, uint32_t *size, size_t *count) {
    size_t skip = strlen(*header) + 1;
    *header += skip;
    *size -= (uint32_t)skip;
    (*count)--;
}

/* 0, or -1 for anything that is not the protocol (the connection is then just closed). */
static int read_request(int conn, struct request *req) {
    unsigned char fixed[12];
    if (read_exact(conn, fixed, sizeof fixed))
        return -1;
    uint32_t size = be32(fixed), argc = be32(fixed + 4), word = be32(fixed + 8);
    uint32_t nstdin = word & LENGTH_BITS;
    req->streamed = (word & STREAMED) != 0;
    req->terminal = (word & TERMINAL) != 0;
    req->as_user = (word & AS_USER) != 0;
    req->drop_caps = 0;
    req->nlimits = 0;
    if (size == 0 || size > MAX_HEADER || argc == 0 || argc > size || nstdin > MAX_STDIN ||
        (req->streamed && nstdin))
        return -1;
    char *header = malloc(size);
    if (!header || read_exact(conn, header, size) || header[size - 1] != '\0')
        return -1;
    size_t count = 0; /* strings in the header */
    for (uint32_t i = 0; i < size; i++)
        count += header[i] == '\0';
    if (word & SETS_LIMITS) { /* the limits first, then as version 4 */
        if (count < 2 + (size_t)argc || parse_limits(header, req))
            return -1;
        skip_string(&header, &size, &count);
    }
    if (word & DROPS_CAPS) { /* the mask first, then as version 3 */
        char *end;
        errno = 0;
        req->drop_caps = strtoull(header, &end, 16);
        if (count < 2 + (size_t)argc || end == header || *end != '\0' || errno)
            return -1;
        skip_string(&header, &size, &count);
    }
    if (req->as_user) { /* the user first, then as version 2 */
        if (count < 2 + (size_t)argc || parse_user(header, req))
            return -1;
        skip_string(&header, &size, &count);
    }
    if (count < 1 + (size_t)argc)
        return -1;
    char **strings = calloc(count + 2, sizeof *strings); /* two NULL terminators */
    if (!strings)
        return -1;
    char *p = header;
    for (size_t i = 0; i < count; i++) {
        strings[i] = p;
        p += strlen(p) + 1;
    }
    /* strings: cwd, argv..., NULL (moved below), env..., NULL */
    req->cwd = strings[0];
    req->argv = calloc(argc + 1, sizeof *req->argv);
    if (!req->argv)
        return -1;
    memcpy(req->argv, strings + 1, argc * sizeof *req->argv);
    req->env = strings + 1 + argc;
    req->stdin_size = nstdin;
    req->stdin_data = NULL;
    if (nstdin) {
        req->stdin_data = malloc(nstdin);
        if (!req->stdin_data || read_exact(conn, req->stdin_data, nstdin))
            return -1;
    }
    return 0;
}

/* Drop req->drop_caps from the bounding set: while this process is still the server's
 * user, whose CAP_SETPCAP it takes. Only those still there (a sandbox made without some
 * has none of them to drop). */
static int drop_bounding(uint64_t drop) {
    for (int cap = 0; cap < 64; cap++) {
        if (!(drop >> cap & 1) || prctl(PR_CAPBSET_READ, cap, 0, 0, 0) != 1)
            continue;
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0)
            return -1;
    }
    return 0;
}

/* ... and from the permitted, effective, inheritable and ambient sets, after the user
 * changed (setuid wants CAP_SETUID). */
static int drop_the_rest(uint64_t drop) {
    struct __user_cap_header_struct head = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    if (syscall(SYS_capget, &head, data) != 0)
        return -1;
    for (int i = 0; i < 2; i++) {
        uint32_t keep = ~(uint32_t)(drop >> (32 * i));
        data[i].permitted &= keep;
        data[i].effective &= keep;
        data[i].inheritable &= keep;
    }
    if (syscall(SYS_capset, &head, data) != 0)
        return -1;
    return prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) == 0 || errno == EINVAL ? 0 : -1;
}

/* In the forked child: becomes the command, or reports errno on `report` and exits. */
static void become(const struct request *req, int in, int out, int err, int report) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGPIPE, SIG_DFL);
    signal(SIGCHLD, SIG_DFL);
    setsid(); /* its own process group, killed as one */
    int step = STEP_SETUP;
    if (req->terminal && ioctl(in, TIOCSCTTY, 0) < 0) /* in: the terminal, as are out, err */
        goto fail;
    if (dup2(in, 0) < 0 || dup2(out, 1) < 0 || dup2(err, 2) < 0)
        goto fail;
    /* Another user: groups, group, then user (after which no more can change); the
     * server keeps its own. Before the chdir, so that the directory is entered as the
     * command's user would. */
    for (size_t i = 0; i < req->nlimits; i++)
        if (setrlimit(req->limits[i].resource, &req->limits[i].value) < 0)
            goto fail;
    if (req->drop_caps && drop_bounding(req->drop_caps))
        goto fail;
    if (req->as_user && (setgroups(req->ngroups, req->groups) || setgid(req->gid) ||
                         setuid(req->uid)))
        goto fail;
    if (req->drop_caps && drop_the_rest(req->drop_caps))
        goto fail;
    step = STEP_CWD;
    if (chdir(req->cwd[0] ? req->cwd : "/") < 0)
        goto fail;
    step = STEP_EXEC;
    environ = req->env; /* execvp looks the command up on the command's own PATH */
    execvp(req->argv[0], req->argv);
fail:;
    int failed[2] = {step, errno};
    ssize_t ignored = write(report, failed, sizeof failed);
    (void)ignored;
    _exit(127);
}

/* The command did not start: one stderr line, as a shell would say it (and as the
 * agent says it when it checks a command itself), and `code`. */
static void say_cannot_start(int conn, const char *what, int error, int code) {
    char message[4096];
    const char *why = error == ENOENT ? "command not found"
                      : error == EACCES ? "permission denied"
                                        : strerror(error);
    int n = snprintf(message, sizeof message, "%s: %s\n", what, why);
    if (n >= (int)sizeof message)
        n = sizeof message - 1;
    if (send_frame(conn, STDERR_FRAME, message, (uint32_t)n) == 0)
        send_exit(conn, code);
}

static void cannot_start(int conn, const char *what, int error, int code) {
    say_cannot_start(conn, what, error, code);
    _exit(0);
}

static int pidfd_open_(pid_t pid) { return (int)syscall(SYS_pidfd_open, pid, 0); }

/* One command, in a process of its own (forked per connection). */
/* The command's terminal: a pseudo-terminal pair from the sandbox's own devpts. The
 * master is checked to be /dev/ptmx (5:2): /dev is the sandbox's, and its code may have
 * put something else there. The slave is opened from the master (TIOCGPTPEER), not by
 * a path in /dev/pts. */
static int open_terminal(int *master, int *slave) {
    struct stat st;
    int unlock = 0;
    *master = open("/dev/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC | O_NONBLOCK);
    if (*master < 0)
        return -1;
    if (fstat(*master, &st) || !S_ISCHR(st.st_mode) || st.st_rdev != makedev(5, 2) ||
        ioctl(*master, TIOCSPTLCK, &unlock)) {
        errno = ENOTTY;
        return -1;
    }
    *slave = ioctl(*master, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
    return *slave < 0 ? -1 : 0;
}

/* stdin as it comes in frames from the agent (a streamed request). */
static struct {
    unsigned char inbox[2 * FRAME]; /* bytes received, whole frames and a partial one */
    size_t inbox_len;
    char pending[2 * FRAME]; /* stdin bytes taken from frames, not yet written */
    size_t pending_off, pending_len;
    int ended; /* its end frame came */
} feed;

/* Whole frames out of the inbox: stdin bytes to pending, a size to the terminal.
 * -1: not the protocol. */
static int take_frames(int terminal) {
    size_t at = 0;
    while (feed.inbox_len - at >= 5) {
        unsigned char kind = feed.inbox[at];
        uint32_t size = be32(feed.inbox + at + 1);
        if (size > FRAME || (kind != STDIN_FRAME && kind != RESIZE_FRAME) ||
            (kind == STDIN_FRAME && feed.ended))
            return -1;
        if (feed.inbox_len - at - 5 < size)
            break;
        const unsigned char *data = feed.inbox + at + 5;
        if (kind == STDIN_FRAME && size == 0) {
            feed.ended = 1;
        } else if (kind == STDIN_FRAME) {
            if (feed.pending_len + size > sizeof feed.pending)
                return -1;
            memcpy(feed.pending + feed.pending_len, data, size);
            feed.pending_len += size;
        } else if (size == 4 && terminal >= 0) {
            struct winsize ws = {.ws_row = (unsigned short)(data[0] << 8 | data[1]),
                                 .ws_col = (unsigned short)(data[2] << 8 | data[3])};
            ioctl(terminal, TIOCSWINSZ, &ws);
        }
        at += 5 + size;
    }
    memmove(feed.inbox, feed.inbox + at, feed.inbox_len - at);
    feed.inbox_len -= at;
    return 0;
}

/* One command, in a process of its own (forked per connection). */
static void serve_one(int conn) {
    struct request req;
    if (read_request(conn, &req))
        _exit(0);
    /* in, out, err: the command's end [0] or [1] and ours; on a terminal all three of its
     * ends are the slave, and ours are the master (out[0]) and a copy of it (in[1]). */
    int in[2] = {-1, -1}, out[2] = {-1, -1}, err[2] = {-1, -1}, report[2] = {-1, -1};
    int opened = !pipe2(report, O_CLOEXEC);
    if (opened && req.terminal) {
        int master, slave;
        opened = !open_terminal(&master, &slave) &&
                 (in[1] = fcntl(master, F_DUPFD_CLOEXEC, 0)) >= 0;
        if (opened) {
            out[0] = master;
            in[0] = out[1] = err[1] = slave;
        }
    } else if (opened) {
        opened = !pipe2(out, O_CLOEXEC) && !pipe2(err, O_CLOEXEC) &&
                 (req.stdin_size || req.streamed
                      ? !pipe2(in, O_CLOEXEC)
                      : (in[0] = open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0);
    }
    pid_t pid = opened ? fork() : -1;
    if (pid < 0) /* out of processes (--pids) or descriptors: as Popen would say it */
        cannot_start(conn, req.argv[0], errno, 126);
    if (pid == 0)
        become(&req, in[0], out[1], err[1], report[1]);
    close(in[0]);
    if (!req.terminal) { /* on a terminal they are in[0], closed already */
        close(out[1]);
        close(err[1]);
    }
    close(report[1]);
    int failed[2]; /* step, errno: the command did not start */
    ssize_t got;
    do
        got = read(report[0], failed, sizeof failed);
    while (got < 0 && errno == EINTR);
    if (got == (ssize_t)sizeof failed) {
        waitpid(pid, NULL, 0);
        if (failed[0] == STEP_CWD) /* not the command's fault: say what is missing */
            say_cannot_start(conn, req.cwd, failed[1] == ENOENT ? ENOTDIR : failed[1], 127);
        else
            say_cannot_start(conn, req.argv[0], failed[1], failed[1] == ENOENT ? 127 : 126);
        _exit(0);
    }
    send_int(conn, PID_FRAME, pid); /* as the sandbox sees it: this server is its PID 1 */
    int exited = pidfd_open_(pid);
    if (exited < 0) { /* cannot watch it: do not leave it running unwatched */
        kill(-pid, SIGKILL);
        _exit(1);
    }
    if (in[1] >= 0)
        fcntl(in[1], F_SETFL, O_NONBLOCK);
    /* stdin given whole comes from the request; streamed, from frames (feed). On a
     * terminal, its end is a ^D typed, not a close: that would hang the terminal up. A
     * terminal with no stdin at all stays open, as `docker exec -t` without -i leaves it. */
    const char *source = req.stdin_data;
    size_t fed = 0, total = req.stdin_size;
    int has_stdin = req.streamed || req.stdin_size > 0;
    int status = 0, done = 0, hung_up = 0, open_pipes = req.terminal ? 1 : 2;
    long long drain_until = 0;
    static char buf[FRAME];
    for (;;) {
        if (req.streamed) { /* what the frames gave, until they end */
            source = feed.pending;
            fed = feed.pending_off;
            total = feed.pending_len;
        }
        int writing = in[1] >= 0 && fed < total;
        int stdin_done = has_stdin && fed == total && (!req.streamed || feed.ended);
        if (in[1] >= 0 && stdin_done) {
            if (req.terminal) {
                char eot = EOT;
                ssize_t ignored = write(in[1], &eot, 1);
                (void)ignored;
            }
            close(in[1]); /* all fed */
            in[1] = -1;
        }
        /* Streamed: frames are read only once what came is written (backpressure). */
        int reading = !req.streamed || (fed == total && !feed.ended);
        struct pollfd fds[5] = {
            {out[0], POLLIN, 0},
            {err[0], POLLIN, 0},
            {hung_up ? -1 : conn, (short)(reading ? POLLIN : 0), 0},
            {done ? -1 : exited, POLLIN, 0},
            {in[1], (short)(writing ? POLLOUT : 0), 0},
        };
        int timeout = -1;
        if (done) {
            if (open_pipes == 0 || hung_up)
                break;
            timeout = (int)(drain_until - now_ms());
            if (timeout <= 0)
                break;
        }
        if (poll(fds, 5, timeout) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        for (int i = 0; i < 2; i++) {
            if (fds[i].fd < 0 || !fds[i].revents)
                continue;
            ssize_t n = read(fds[i].fd, buf, sizeof buf);
            if (n < 0 && (errno == EINTR || errno == EAGAIN))
                continue;
            if (n <= 0) { /* a terminal's master reads EIO once the command's side is closed */
                close(fds[i].fd);
                *(i == 0 ? &out[0] : &err[0]) = -1;
                open_pipes--;
            } else if (!hung_up &&
                       send_frame(conn, i == 0 ? STDOUT_FRAME : STDERR_FRAME, buf, (uint32_t)n)) {
                hung_up = 1;
                kill(-pid, SIGKILL);
            }
        }
        if (fds[2].fd >= 0 && fds[2].revents) {
            ssize_t n = 0;
            if (fds[2].revents & POLLIN)
                n = recv(conn, feed.inbox + feed.inbox_len, sizeof feed.inbox - feed.inbox_len, 0);
            if (n < 0 && errno == EINTR)
                continue;
            if (n <= 0) { /* the agent left: timeout, client gone */
                hung_up = 1;
                kill(-pid, SIGKILL);
            } else if (!req.streamed) {
                feed.inbox_len = 0; /* nothing more is expected: ignored */
            } else {
                feed.inbox_len += (size_t)n;
                if (take_frames(req.terminal ? in[1] : -1)) {
                    hung_up = 1; /* not the protocol: as if it left */
                    kill(-pid, SIGKILL);
                }
            }
        }
        if (fds[3].fd >= 0 && fds[3].revents) {
            waitpid(pid, &status, 0);
            done = 1;
            drain_until = now_ms() + DRAIN_MS;
        }
        if (fds[4].fd >= 0 && fds[4].revents) {
            int gone = !(fds[4].revents & POLLOUT); /* POLLERR: the command closed it */
            if (!gone) {
                ssize_t n = write(in[1], source + fed, total - fed);
                if (n > 0)
                    fed += (size_t)n;
                gone = n < 0 && errno != EAGAIN && errno != EINTR;
            }
            if (req.streamed) {
                feed.pending_off = fed;
                if (feed.pending_off == feed.pending_len) /* all written: room for more */
                    feed.pending_off = feed.pending_len = 0;
            }
            if (gone) { /* nobody reads it any more */
                close(in[1]);
                in[1] = -1;
                has_stdin = 0;
                if (req.streamed)
                    feed.pending_off = feed.pending_len = 0;
            }
        }
    }
    if (!done) /* the agent left before the command ended */
        waitpid(pid, &status, 0);
    if (!hung_up)
        send_exit(conn, WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status));
    _exit(0);
}

/* fd 3 must be a listening unix stream socket: anything else is a launch gone wrong. */
static int take_listener(void) {
    int listening = 0, domain = 0;
    socklen_t size = sizeof listening;
    if (getsockopt(LISTENER, SOL_SOCKET, SO_ACCEPTCONN, &listening, &size) || !listening) {
        fprintf(stderr, "lazyfs-exec-server: fd %d is not a listening socket\n", LISTENER);
        return -1;
    }
    size = sizeof domain;
    if (getsockopt(LISTENER, SOL_SOCKET, SO_DOMAIN, &domain, &size) || domain != AF_UNIX) {
        fprintf(stderr, "lazyfs-exec-server: fd %d is not a unix socket\n", LISTENER);
        return -1;
    }
    if (fcntl(LISTENER, F_SETFD, FD_CLOEXEC)) { /* no command ever inherits it */
        perror("lazyfs-exec-server: fcntl");
        return -1;
    }
    return LISTENER;
}

int main(void) {
    /* Before anything else: from here on, sandbox root cannot ptrace this process, read
     * its memory or take its descriptors; the processes it forks inherit it. */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)) {
        perror("lazyfs-exec-server: prctl(PR_SET_DUMPABLE)");
        return 1;
    }
    int server = take_listener();
    if (server < 0)
        return 2;
    /* each connection's process, and every orphan re-parented to PID 1, is reaped by
     * the kernel as it exits */
    signal(SIGCHLD, SIG_IGN);
    signal(SIGPIPE, SIG_IGN);
    for (;;) {
        int conn = accept4(server, NULL, NULL, SOCK_CLOEXEC);
        if (conn < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            if (errno == EMFILE || errno == ENFILE || errno == ENOMEM || errno == ENOBUFS) {
                usleep(10000); /* out of something: the agent retries, do not spin */
                continue;
            }
            perror("lazyfs-exec-server: accept");
            return 1;
        }
        pid_t pid = fork();
        if (pid == 0) {
            close(server);
            signal(SIGCHLD, SIG_DFL);
            serve_one(conn);
        }
        if (pid < 0) { /* out of processes (--pids): the command cannot start either */
            int error = errno;
            char junk[4096]; /* the request: closing with it unread would reset the agent */
            while (recv(conn, junk, sizeof junk, MSG_DONTWAIT) > 0)
                ;
            say_cannot_start(conn, "lazyfs-exec-server: fork", error, 126);
        }
        close(conn);
    }
}
