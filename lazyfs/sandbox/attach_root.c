/* lazyfs-attach-root [--read-only] [--hostname NAME] PID TREE [DEST FLAGS DATA]...: give
 * the warm sandbox whose PID 1 is PID the directory TREE (a mount on the host: the
 * image's private overlay, nosuid and nodev) as the root of every process in the
 * sandbox's mount namespace, then mount the tmpfs mounts the claim asked for (each DEST
 * with mount(2)'s FLAGS, a decimal number, and DATA, its options: lazyfs/sandbox/tmpfs.py
 * checked and made them), and with --read-only make that root read-only; with
 * --hostname, first name the sandbox NAME in its UTS namespace
 * (lazyfs/sandbox/names.py checked it). Run by the
 * agent on the host, as root, when it hands a generic sandbox to an image (issue 23;
 * docs/design-changes.md, "how a warm sandbox takes an image's root"). Exit 0, or 1
 * with one line on stderr.
 *
 * The order matters:
 * 0. --hostname: the sandbox's UTS namespace, opened with its mount namespace before
 *    this process leaves the host's /proc, is joined and named (sethostname).
 * 1. The tree is cloned (open_tree OPEN_TREE_CLONE|AT_RECURSIVE) in the host's mount
 *    namespace, where it is mounted; the clone is a detached mount this process holds.
 * 2. The process joins the sandbox's mount namespace (setns, which wants the fs struct
 *    unshared first), attaches the clone at /newroot (a directory of the read-only
 *    start-up root), and makes it private: no mount on the host propagates into it.
 * 3. It moves the sandbox's /proc, /dev, /sys and /run under it (MS_MOVE takes their submounts
 *    along: the masked and read-only paths, /dev/pts, /dev/shm, the exec server's bind).
 * 4. pivot_root(".", ".") in /newroot: the kernel moves the root and cwd of every process
 *    whose root or cwd was the old root (tini or the exec server, PID 1 included); the
 *    old root, stacked on top, is then detached and unreachable from the sandbox.
 * 5. The tmpfs mounts, at paths resolved from the new root (this process's too, after
 *    the pivot): made (with their parents) in the sandbox's own writable layer if
 *    missing, as runc makes a spec's mount points; a symlink on the way resolves inside
 *    the sandbox, never on the host. No code of the sandbox has run in it yet. One at
 *    a mount of the runtime's own (/dev/shm, /run) replaces it.
 * 6. --read-only: the new root's mount (the sandbox's clone, not the host's mount of the
 *    tree) becomes read-only with mount_setattr, which leaves its other flags (nosuid,
 *    nodev) as they are; last, since the tmpfs mount points may have been made in it.
 *
 * Safety: the target namespaces must be neither this process's nor the host's init's, so
 * that a stale PID never pivots or renames the host; the start-up root must have /newroot.
 * Why C: a static binary starts and finishes in ~1.6 ms (a fork of the agent's Python
 * process, 2.8-6 ms), and setns(CLONE_NEWNS) needs a single-threaded process.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef OPEN_TREE_CLOEXEC
#define OPEN_TREE_CLOEXEC O_CLOEXEC
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif
#ifndef MOUNT_ATTR_RDONLY
#define MOUNT_ATTR_RDONLY 0x00000001
#endif
struct lazyfs_mount_attr { /* the kernel's struct mount_attr (Linux 5.12) */
    unsigned long long attr_set, attr_clr, propagation, userns_fd;
};

static int fail(const char *what) {
    fprintf(stderr, "lazyfs-attach-root: %s: %s\n", what, strerror(errno));
    return 1;
}

static int refuse(const char *why) {
    fprintf(stderr, "lazyfs-attach-root: %s\n", why);
    return 1;
}

static int same_file(const char *a, const char *b) {
    struct stat sa, sb;
    if (stat(a, &sa) != 0 || stat(b, &sb) != 0)
        return -1;
    return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

/* mkdir -p PATH (absolute, from this process's root), 0755 for what it makes. */
static int make_dirs(const char *path) {
    char buf[4096];
    size_t n = strlen(path);
    if (n >= sizeof buf) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(buf, path, n + 1);
    for (char *p = buf + 1;; p++) {
        if (*p == '/' || *p == '\0') {
            char was = *p;
            *p = '\0';
            if (mkdir(buf, 0755) != 0 && errno != EEXIST)
                return -1;
            *p = was;
            if (was == '\0')
                return 0;
        }
    }
}

/* The namespace of kind `kind` (e.g. "mnt") of process pid, opened; -1 with one line on
 * stderr if it cannot be, or if it is this process's or the host init's. */
static int sandbox_ns(long pid, const char *kind) {
    char path[64], self[64], init[64];
    snprintf(path, sizeof path, "/proc/%ld/ns/%s", pid, kind);
    snprintf(self, sizeof self, "/proc/self/ns/%s", kind);
    snprintf(init, sizeof init, "/proc/1/ns/%s", kind);
    int ns = open(path, O_RDONLY | O_CLOEXEC);
    if (ns < 0) {
        fail(path);
        return -1;
    }
    /* (/proc/1 may be out of reach, in a container: -1 there is no refusal.) */
    if (same_file(path, self) != 0 || same_file(path, init) == 1) {
        fprintf(stderr, "lazyfs-attach-root: that process is in the host's %s namespace,"
                        " not a sandbox's\n", kind);
        return -1;
    }
    return ns;
}

int main(int argc, char **argv) {
    int read_only = 0;
    const char *hostname = NULL;
    for (;;) {
        if (argc > 1 && strcmp(argv[1], "--read-only") == 0) {
            read_only = 1;
            argc -= 1;
            argv += 1;
        } else if (argc > 2 && strcmp(argv[1], "--hostname") == 0) {
            hostname = argv[2];
            argc -= 2;
            argv += 2;
        } else {
            break;
        }
    }
    if (argc < 3 || (argc - 3) % 3 != 0) {
        fprintf(stderr, "usage: lazyfs-attach-root [--read-only] [--hostname NAME] PID TREE"
                        " [DEST FLAGS DATA]...\n");
        return 2;
    }
    char *end;
    long pid = strtol(argv[1], &end, 10);
    if (*argv[1] == '\0' || *end != '\0' || pid < 2)
        return refuse("PID must be a process id above 1");
    int ns = sandbox_ns(pid, "mnt");
    if (ns < 0)
        return 1;
    if (hostname != NULL) {
        int uts = sandbox_ns(pid, "uts");
        if (uts < 0)
            return 1;
        if (setns(uts, CLONE_NEWUTS) != 0)
            return fail("setns(uts)");
        if (sethostname(hostname, strlen(hostname)) != 0)
            return fail("sethostname");
        close(uts);
    }

    int tree = (int)syscall(SYS_open_tree, AT_FDCWD, argv[2],
                            OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE);
    if (tree < 0)
        return fail(argv[2]);
    if (unshare(CLONE_FS) != 0)
        return fail("unshare(CLONE_FS)");
    if (setns(ns, CLONE_NEWNS) != 0)
        return fail("setns");
    if (syscall(SYS_move_mount, tree, "", AT_FDCWD, "/newroot", MOVE_MOUNT_F_EMPTY_PATH) != 0)
        return fail("attach at /newroot");
    if (mount(NULL, "/newroot", NULL, MS_REC | MS_PRIVATE, NULL) != 0)
        return fail("make /newroot private");
    static const char *moved[] = {"/proc", "/dev", "/sys", "/run"};
    for (size_t i = 0; i < sizeof moved / sizeof *moved; i++) {
        char to[32];
        snprintf(to, sizeof to, "/newroot%s", moved[i]);
        if (mkdir(to, 0755) != 0 && errno != EEXIST)
            return fail(to);
        if (mount(moved[i], to, NULL, MS_MOVE, NULL) != 0)
            return fail(to);
    }
    if (chdir("/newroot") != 0)
        return fail("chdir /newroot");
    if (syscall(SYS_pivot_root, ".", ".") != 0)
        return fail("pivot_root");
    if (umount2(".", MNT_DETACH) != 0)
        return fail("detach the start-up root");
    if (chdir("/") != 0)
        return fail("chdir /");
    for (int i = 3; i + 2 < argc; i += 3) {
        unsigned long flags = strtoul(argv[i + 1], &end, 10);
        if (argv[i][0] != '/' || *argv[i + 1] == '\0' || *end != '\0')
            return refuse("a tmpfs wants an absolute DEST and decimal FLAGS");
        if (make_dirs(argv[i]) != 0)
            return fail(argv[i]);
        /* One of the runtime's own there (/dev/shm, /run) is replaced, as a spec's mount
         * of the same destination replaces it at a cold create: EINVAL, not a mount. */
        if (umount2(argv[i], MNT_DETACH | UMOUNT_NOFOLLOW) != 0 && errno != EINVAL)
            return fail(argv[i]);
        if (mount("tmpfs", argv[i], "tmpfs", flags, argv[i + 2]) != 0)
            return fail(argv[i]);
    }
    struct lazyfs_mount_attr attr = {.attr_set = MOUNT_ATTR_RDONLY};
    if (read_only && syscall(SYS_mount_setattr, AT_FDCWD, "/", 0, &attr, sizeof attr) != 0)
        return fail("make the root read-only");
    return 0;
}
