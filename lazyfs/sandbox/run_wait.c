/* lazyfs-run-wait: what a `lazyfs run` is while it waits, instead of a Python process.
 *
 * Why C: a burst of `lazyfs run`s is one CLI per sandbox, and each stays alive for its
 * sandbox's whole life only to wait for it and clean up after it. As Python that was
 * ~26 MB of RSS per sandbox (a bare python3 is ~10 MB), 850 MB for a burst of 32; this
 * static binary is ~0.7 MB (VmRSS, measured). The Python CLI prepares, creates and starts the
 * sandbox, then execs this (lazyfs/sandbox/run_wait.py). Once the command has ended, this
 * deletes the sandbox and releases the image's trees itself (run_teardown.c) in the plain
 * case, and otherwise execs the Python finisher (lazyfs/sandbox/run_finish.py), which
 * does it as the CLI always did. The pid, the stdio, the parenthood of
 * the sandbox's init (PR_SET_CHILD_SUBREAPER survives execve) and the inherited lock
 * descriptors (the sandbox's lock file, the tree holds') are the same process's
 * throughout: to its caller, and to cleanup_stale after a kill -9, nothing changed.
 *
 *   lazyfs-run-wait wait PID SLOTS N FIELD... -- PROGRAM ARG...
 *       PID is the sandbox's init, a child of this process. SIGTERM, SIGINT or SIGHUP
 *       kill it (SIGKILL: the kernel ends its PID namespace with it) and the result is
 *       128 + the first such signal, as Sandbox.run_foreground does; otherwise the
 *       command's exit status, 128+N if signal N killed it. The FIELDs (run_finish.py's
 *       FIELDS and TREE_FIELDS, run_teardown.h) say what to delete and release, their
 *       count given by one of them (F_TREES); then exit with the
 *       result. PROGRAM ARG... is the Python finisher, for what run_teardown.c leaves
 *       to it: then one of the N finish slots (below), and exec PROGRAM ARG... FIELD...
 *       STATUS (the result as one more argument).
 *   lazyfs-run-wait gate SLOTS N -- PROGRAM ARG...
 *       Wait for a slot, then exec PROGRAM ARG... with the slot's descriptor open, its
 *       number in $LAZYFS_RUN_SLOT: how a `lazyfs run` that found no free slot waits
 *       for one at < 1 MB instead of as a 10-26 MB Python process.
 *
 * Slots: the node-wide bound on how many `lazyfs run`s are Python at once: SLOTS/slot-I.lock
 * for I in [0, N) for setting up a sandbox (its `runtime create` included), and apart,
 * so that finishing never holds up starting, SLOTS/finish-I.lock for the finishers. One
 * is held = flock'd exclusively by an open descriptor, so a killed holder frees it.
 * SLOTS/slot-queue.lock (finish-queue.lock) orders the waiters: the one holding it polls
 * the slots every 5 ms, the others block on it in the kernel. The Python side
 * (lazyfs/sandbox/run_wait.py) takes a free setup slot the same way, without waiting.
 *
 * Built by scripts/build_helpers.py with run_teardown.c: cc -O2 -static.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "run_teardown.h"

#define MAX_SLOTS 1024
#define POLL_NS 5000000L /* 5 ms between polls of the slots by the queue's head */

static volatile sig_atomic_t first_signal;
static volatile pid_t init_pid; /* 0 once it is about to be reaped: never kill a reused pid */

static void fail(const char *what, int err) {
    if (err)
        fprintf(stderr, "lazyfs: %s: %s\n", what, strerror(err));
    else
        fprintf(stderr, "lazyfs: %s\n", what);
}

static void usage(void) {
    fail("usage: lazyfs-run-wait wait PID SLOTS N FIELD... -- PROGRAM ARG... |"
         " gate SLOTS N -- PROGRAM ARG...",
         0);
    exit(2);
}

static long number(const char *text, long lo, long hi) {
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno || end == text || *end || v < lo || v > hi)
        usage();
    return v;
}

static void on_signal(int sig) {
    if (!first_signal)
        first_signal = sig;
    pid_t pid = init_pid;
    if (pid > 0)
        kill(pid, SIGKILL);
}

static void on_gate_signal(int sig) {
    /* Nothing exists yet to clean up: leave as the CLI would have. */
    if (sig == SIGINT) {
        static const char msg[] = "lazyfs: interrupted\n";
        ssize_t ignored = write(2, msg, sizeof msg - 1);
        (void)ignored;
    }
    _exit(128 + sig);
}

static void handle(void (*handler)(int)) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = handler;
    sigemptyset(&sa.sa_mask);
    sigaddset(&sa.sa_mask, SIGTERM);
    sigaddset(&sa.sa_mask, SIGINT);
    sigaddset(&sa.sa_mask, SIGHUP);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
}

static void forwarded(sigset_t *set) {
    sigemptyset(set);
    sigaddset(set, SIGTERM);
    sigaddset(set, SIGINT);
    sigaddset(set, SIGHUP);
}

/* A free slot's descriptor (flock'd, inheritable), or -1 if all N are taken. */
static int try_slots(const int *fds, int n) {
    for (int i = 0; i < n; i++)
        if (flock(fds[i], LOCK_EX | LOCK_NB) == 0)
            return i;
    return -1;
}

static int take_slot(const char *dir, const char *kind, int n) {
    char path[PATH_MAX];
    static int fds[MAX_SLOTS];
    for (int i = 0; i < n; i++) {
        snprintf(path, sizeof path, "%s/%s-%d.lock", dir, kind, i);
        fds[i] = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        if (fds[i] < 0) {
            fail(path, errno);
            exit(1);
        }
    }
    snprintf(path, sizeof path, "%s/%s-queue.lock", dir, kind);
    int queue = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (queue < 0) {
        fail(path, errno);
        exit(1);
    }
    while (flock(queue, LOCK_EX) != 0) {
        if (errno != EINTR) {
            fail(path, errno);
            exit(1);
        }
    }
    int got;
    while ((got = try_slots(fds, n)) < 0) {
        struct timespec ts = {0, POLL_NS};
        nanosleep(&ts, NULL);
    }
    close(queue); /* the next in line polls now */
    for (int i = 0; i < n; i++)
        if (i != got)
            close(fds[i]);
    if (fcntl(fds[got], F_SETFD, 0) != 0) { /* kept across the exec */
        fail("fcntl", errno);
        exit(1);
    }
    return fds[got];
}

static void run(char **argv) {
    execv(argv[0], argv);
    char what[PATH_MAX + 32];
    snprintf(what, sizeof what, "cannot run %s", argv[0]);
    fail(what, errno);
}

static int gate(int argc, char **argv) {
    /* gate SLOTS N -- PROGRAM ARG... */
    if (argc < 6 || strcmp(argv[4], "--") != 0)
        usage();
    int n = (int)number(argv[3], 1, MAX_SLOTS);
    handle(on_gate_signal);
    sigset_t set;
    forwarded(&set);
    sigprocmask(SIG_UNBLOCK, &set, NULL);
    int fd = take_slot(argv[2], "slot", n);
    char value[16];
    snprintf(value, sizeof value, "%d", fd);
    setenv("LAZYFS_RUN_SLOT", value, 1);
    run(argv + 5);
    return 1;
}

static int wait_for(int argc, char **argv) {
    /* wait PID SLOTS N FIELD... -- PROGRAM ARG... */
    if (argc < 5 + N_FIELDS)
        usage();
    char **fields = argv + 5;
    int n_fields = count_fields(fields);
    int program = 5 + n_fields + 1; /* PROGRAM's index */
    if (n_fields < 0 || argc < program + 1 || strcmp(argv[program - 1], "--") != 0)
        usage();
    pid_t pid = (pid_t)number(argv[2], 1, INT_MAX);
    int n = (int)number(argv[4], 1, MAX_SLOTS);
    init_pid = pid;
    handle(on_signal);
    sigset_t set;
    forwarded(&set);
    /* The CLI blocked them before its exec, so none came unseen; any pending now kills
     * the sandbox at once. */
    sigprocmask(SIG_UNBLOCK, &set, NULL);

    int result;
    siginfo_t info;
    /* Wait without reaping first: while the zombie stays, its pid cannot be reused, so
     * a signal handler that runs meanwhile still kills the right process (or none). */
    for (;;) {
        memset(&info, 0, sizeof info);
        if (waitid(P_PID, (id_t)pid, &info, WEXITED | WNOWAIT) == 0)
            break;
        if (errno != EINTR) {
            char what[64];
            snprintf(what, sizeof what, "cannot wait for the sandbox's init (pid %d)", pid);
            fail(what, errno);
            break;
        }
    }
    sigprocmask(SIG_BLOCK, &set, NULL);
    init_pid = 0;
    int status;
    if (waitpid(pid, &status, 0) == pid)
        result = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    else
        result = 1;
    if (first_signal)
        result = 128 + first_signal;
    /* Signals from here on change nothing: the sandbox is over. The handler (pid 0)
     * swallows them through the teardown; a Python finisher then has the defaults, as
     * the CLI did after its wait. */
    sigprocmask(SIG_UNBLOCK, &set, NULL);

    if (teardown(fields, argv[program], &result) == 0)
        return result;
    take_slot(argv[3], "finish", n); /* held by the finisher: it is Python again */
    int nargs = argc - program;
    char **args = calloc((size_t)nargs + (size_t)n_fields + 2, sizeof *args);
    char code[16];
    if (!args) {
        fail("out of memory", 0);
        return result;
    }
    memcpy(args, argv + program, (size_t)nargs * sizeof *args);
    memcpy(args + nargs, fields, (size_t)n_fields * sizeof *args);
    snprintf(code, sizeof code, "%d", result);
    args[nargs + n_fields] = code;
    run(args);
    return result; /* the sandbox is left for the next run's cleanup_stale */
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "wait") == 0)
        return wait_for(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "gate") == 0)
        return gate(argc, argv);
    usage();
    return 2;
}
