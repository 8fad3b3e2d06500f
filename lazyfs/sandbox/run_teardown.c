/* The end of a `lazyfs run`, done by lazyfs-run-wait itself once the command ended: the
 * OOM message, the sandbox's delete and its trees' release.
 *
 * Why C: this is on the user's clock after every run. As the Python finisher
 * (lazyfs/sandbox/run_finish.py) it cost a new interpreter, ~16 ms here before its first
 * system call of the delete, against ~2 ms for all of it here (docs/design-changes.md,
 * session 37). The Python finisher stays the one complete implementation: this does the
 * plain case only, step for step as lazyfs/sandbox/teardown.py and
 * lazyfs/tree/tree_release.py do it, and returns -1 at anything else (a directory deeper
 * than plain files, a FUSE tree to unmount, a failed call it would have to report). The
 * waiter then execs the Python finisher, which starts over: every step is idempotent, and
 * the OOM count is read before the one step that clears it, which never hands over.
 */
#define _GNU_SOURCE
#include "run_teardown.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define CGROUP_FS "/sys/fs/cgroup"
#define DATA_FSTYPE "fuse.lazyfs-data" /* lazyfs/mount_table.py */
#define FUSE_TREE_FSTYPE "fuse.lazyfs"

extern char **environ;

static int text_int(const char *text, long *out) {
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno || end == text || *end)
        return -1;
    *out = v;
    return 0;
}

/* oom_kills() of teardown.py: the memory cgroup's OOM kill count, v1 or v2. */
static long oom_kills(const char *parent, const char *box) {
    static const char *const forms[] = {CGROUP_FS "/memory/%s/%s/memory.oom_control",
                                        CGROUP_FS "/%s/%s/memory.events"};
    for (size_t i = 0; i < sizeof forms / sizeof *forms; i++) {
        char path[PATH_MAX], line[256];
        snprintf(path, sizeof path, forms[i], parent, box);
        FILE *f = fopen(path, "re");
        if (!f)
            continue;
        long n = 0;
        while (fgets(line, sizeof line, f))
            if (strncmp(line, "oom_kill ", 9) == 0)
                n = strtol(line + 9, NULL, 10);
        fclose(f);
        return n;
    }
    return 0;
}

/* remove_cgroups() of teardown.py: kill what still runs in the sandbox's cgroup of each
 * hierarchy, then remove it (up to 100 tries, 10 ms apart, while processes exit). */
static void remove_cgroups(const char *parent, const char *box) {
    DIR *root = opendir(CGROUP_FS);
    if (!root)
        return;
    const char *name = NULL; /* first the root itself (v2), then each hierarchy in it */
    for (;;) {
        char path[PATH_MAX], procs[PATH_MAX + 16];
        struct stat st;
        if (name)
            snprintf(path, sizeof path, CGROUP_FS "/%s/%s/%s", name, parent, box);
        else
            snprintf(path, sizeof path, CGROUP_FS "/%s/%s", parent, box);
        if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
            snprintf(procs, sizeof procs, "%s/cgroup.procs", path);
            for (int attempt = 0; attempt < 100; attempt++) {
                FILE *f = fopen(procs, "re");
                if (f) {
                    long pid;
                    while (fscanf(f, "%ld", &pid) == 1)
                        kill((pid_t)pid, SIGKILL);
                    fclose(f);
                }
                if (rmdir(path) == 0 || errno == ENOENT)
                    break;
                struct timespec ts = {0, 10000000L}; /* processes still exiting */
                nanosleep(&ts, NULL);
            }
        }
        struct dirent *e;
        do
            e = readdir(root);
        while (e && (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0));
        if (!e)
            break;
        name = e->d_name;
    }
    closedir(root);
}

/* remove_dir() of teardown.py for its usual case, a directory of plain files or an
 * empty one; -1 for anything deeper or a call that failed. */
static int remove_dir(const char *path) {
    DIR *d = opendir(path);
    if (!d)
        return errno == ENOENT ? 0 : -1;
    struct dirent *e;
    int ok = 0;
    while (ok == 0 && (e = readdir(d))) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        if (e->d_type == DT_DIR || e->d_type == DT_UNKNOWN ||
            unlinkat(dirfd(d), e->d_name, 0) != 0)
            ok = -1;
    }
    closedir(d);
    if (ok == 0 && rmdir(path) != 0 && errno != ENOENT)
        ok = -1;
    return ok;
}

/* unmount() of teardown.py: unmount what is there, if anything; detach it if busy. */
static void unmount(const char *target) {
    if (umount2(target, 0) != 0 && errno != EINVAL && errno != ENOENT)
        umount2(target, MNT_DETACH);
}

/* One field of a mountinfo line, its octal escapes (\040 ...) undone in place. */
static char *mountinfo_field(char **cursor) {
    char *start = *cursor, *out = start, *in = start;
    while (*in && *in != ' ' && *in != '\n') {
        if (in[0] == '\\' && in[1] >= '0' && in[1] <= '3' && in[2] >= '0' && in[2] <= '7' &&
            in[3] >= '0' && in[3] <= '7') {
            *out++ = (char)((in[1] - '0') * 64 + (in[2] - '0') * 8 + (in[3] - '0'));
            in += 4;
        } else {
            *out++ = *in++;
        }
    }
    if (*in)
        in++;
    *out = '\0';
    *cursor = in;
    return start;
}

/* This process's mount table, read once (on a busy node it has a line for each of
 * every sandbox's mounts, and each read waits for the mount namespace's lock): a
 * NUL-terminated buffer to free, or NULL on an error. */
static char *read_mount_table(void) {
    int fd = open("/proc/self/mountinfo", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    size_t len = 0, cap = 64 << 10;
    char *buf = malloc(cap);
    ssize_t n = 0;
    while (buf) {
        if (len + 1 == cap) {
            char *more = realloc(buf, cap *= 2);
            if (!more) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = more;
        }
        n = read(fd, buf + len, cap - len - 1);
        if (n <= 0)
            break;
        len += (size_t)n;
    }
    close(fd);
    if (buf && n < 0) {
        free(buf);
        return NULL;
    }
    if (buf)
        buf[len] = '\0';
    return buf;
}

/* The fstype (and source) of the newest mount at `point` in `table`, as
 * lazyfs/mount_table.py's newest() sees it; 0 if found, 1 if none, -1 on an error. */
static int newest_mount(const char *table, const char *point, char *fstype, size_t ft_size,
                        char *source, size_t src_size) {
    char *line = malloc(strlen(table) + 1); /* a line's copy: its fields are unescaped */
    if (!line)
        return -1;
    int found = 1;
    for (const char *at = table; *at;) {
        const char *end = strchr(at, '\n');
        size_t n = end ? (size_t)(end - at) : strlen(at);
        memcpy(line, at, n);
        line[n] = '\0';
        at += n + (end != NULL);
        char *c = line;
        for (int i = 0; i < 4; i++) /* id, parent, major:minor, root */
            mountinfo_field(&c);
        char *mp = mountinfo_field(&c);
        if (strcmp(mp, point) != 0)
            continue;
        char *field;
        do /* options, optional fields, up to the "-" separator */
            field = mountinfo_field(&c);
        while (*field && strcmp(field, "-") != 0);
        char *type = mountinfo_field(&c);
        char *src = mountinfo_field(&c);
        snprintf(fstype, ft_size, "%s", type);
        snprintf(source, src_size, "%s", src);
        found = 0; /* a later line is a newer mount on top: keep reading */
    }
    free(line);
    return found;
}

/* unmount_if_tree(tree, dead_too=True) of tree_release.py, from one read of the mount
 * table (`table`, as tree_kind() asks both its questions of one read): an EROFS tree
 * over the node's data mount (the plain case) is unmounted, a mount there that is no
 * lazyfs tree (dead) detached; -1 for a FUSE tree or a failed unmount, whose words are
 * the Python finisher's. */
static int unmount_tree_in(const char *table, const char *tree) {
    char fstype[64], source[PATH_MAX], data_type[64], data_source[PATH_MAX];
    int got = newest_mount(table, tree, fstype, sizeof fstype, source, sizeof source);
    if (got < 0)
        return -1;
    if (got > 0)
        return 0; /* nothing mounted there */
    if (strcmp(fstype, "erofs") == 0) {
        char *slash = strrchr(source, '/');
        if (slash && slash != source) {
            *slash = '\0'; /* the source's directory: the data daemon's mount */
            got = newest_mount(table, source, data_type, sizeof data_type, data_source,
                               sizeof data_source);
            if (got < 0)
                return -1;
            if (got == 0 && strcmp(data_type, DATA_FSTYPE) == 0)
                return umount2(tree, 0) == 0 ? 0 : -1;
        }
    } else if (strcmp(fstype, FUSE_TREE_FSTYPE) == 0) {
        return -1; /* a per-image FUSE tree: lazyfs/tree/fuse_mount.py unmounts it */
    }
    umount2(tree, MNT_DETACH); /* a dead tree: its users keep it until they leave */
    return 0;
}

static int unmount_tree(const char *tree) {
    char *table = read_mount_table();
    if (!table)
        return -1;
    int done = unmount_tree_in(table, tree);
    free(table);
    return done;
}

/* start_reaper() of tree_release.py: stamp the lock file with an mtime it never had,
 * then `sh -c 'cd / && sleep LINGER && exec PYTHON -m lazyfs.tree.tree_release reap
 * LOCK TREE STAMP'` in a session of its own, on /dev/null, with no other descriptor. */
static int start_reaper(const char *lock_path, const char *tree, const char *linger,
                        const char *python) {
    struct stat st;
    struct timespec now;
    if (stat(lock_path, &st) != 0 || clock_gettime(CLOCK_REALTIME, &now) != 0)
        return -1;
    long long value = (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
    long long mtime = (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
    if (value <= mtime)
        value = mtime + 1;
    struct timespec times[2] = {{value / 1000000000LL, value % 1000000000LL},
                                {value / 1000000000LL, value % 1000000000LL}};
    if (utimensat(AT_FDCWD, lock_path, times, 0) != 0)
        return -1;
    char stamp[32];
    snprintf(stamp, sizeof stamp, "%lld", value);
    char *argv[] = {"/bin/sh",         "-c", "cd / && sleep \"$0\" && exec \"$@\"",
                    (char *)linger,    (char *)python, "-m", "lazyfs.tree.tree_release",
                    "reap",            (char *)lock_path, (char *)tree, stamp, NULL};
    pid_t pid = fork(); /* this process has one thread: fork is safe here */
    if (pid < 0)
        return -1;
    if (pid == 0) {
        setsid();
        int null = open("/dev/null", O_RDWR);
        if (null >= 0) {
            for (int fd = 0; fd < 3; fd++)
                dup2(null, fd);
        }
        closefrom(3); /* the tree's and the sandbox's locks above all */
        execve(argv[0], argv, environ);
        _exit(127);
    }
    return 0; /* never waited for: it outlives this process */
}

/* same_file() of tree_release.py: whether fd is still the file at path. */
static int same_file(int fd, const char *path) {
    struct stat own, at;
    if (fstat(fd, &own) != 0 || stat(path, &at) != 0)
        return 0;
    return own.st_dev == at.st_dev && own.st_ino == at.st_ino;
}

/* forget_tree() of tree_release.py: an unmounted tree's mount point, device record and
 * mount lock, then its lock file; nothing if the mount point cannot go. */
static void forget_tree(const char *lock_path, const char *tree) {
    static const char *const beside[] = {".device", ".mount.lock"};
    char path[PATH_MAX];
    if (rmdir(tree) != 0 && errno != ENOENT)
        return;
    for (size_t i = 0; i < sizeof beside / sizeof beside[0]; i++)
        if (snprintf(path, sizeof path, "%s%s", tree, beside[i]) < (int)sizeof path)
            unlink(path);
    unlink(lock_path);
}

/* release_tree() of tree_release.py: the last user out unmounts the tree and removes its
 * files, at once or through a reaper after `linger` seconds. */
static int release_tree(int lock_fd, const char *lock_path, const char *tree,
                        const char *linger, double linger_s, const char *python) {
    if (flock(lock_fd, LOCK_EX | LOCK_NB) != 0)
        return errno == EWOULDBLOCK ? 0 : -1; /* another user still has the tree */
    if (!same_file(lock_fd, lock_path))
        return 0; /* another last user came and went since our shared lock */
    if (linger_s > 0)
        return start_reaper(lock_path, tree, linger, python);
    if (unmount_tree(tree) != 0)
        return -1;
    forget_tree(lock_path, tree);
    return 0;
}

int count_fields(char *const *f) {
    long trees;
    if (text_int(f[F_TREES], &trees) || trees < 1 || trees > MAX_TREES)
        return -1;
    return N_FIELDS + (int)trees * N_TREE_FIELDS;
}

int teardown(char *const *f, const char *python, int *status) {
    long lock_fd, memory = -1, tree_fds[MAX_TREES];
    int trees = (count_fields(f) - N_FIELDS) / N_TREE_FIELDS;
    char *const *t = f + N_FIELDS; /* the trees' fields */
    char *end;
    errno = 0;
    double linger_s = strtod(f[F_LINGER], &end);
    if (trees < 1 || errno || end == f[F_LINGER] || *end || !(linger_s >= 0) ||
        text_int(f[F_LOCK_FD], &lock_fd) || (*f[F_MEMORY] && text_int(f[F_MEMORY], &memory)))
        return -1; /* the Python finisher answers bad fields in one line */
    for (int i = 0; i < trees; i++)
        if (text_int(t[i * N_TREE_FIELDS + T_LOCK_FD], &tree_fds[i]) ||
            t[i * N_TREE_FIELDS + T_TREE][0] != '/')
            return -1;

    /* _ending() of run_finish.py: the OOM message, the delete, the release. */
    if (memory >= 0 && oom_kills(f[F_CGROUP_PARENT], f[F_BOX]) > 0) {
        fprintf(stderr,
                "lazyfs: the sandbox ran out of memory (--memory %g MiB) and was killed\n",
                (double)memory / (1 << 20));
        *status = 137;
    }
    /* remove_sandbox() of teardown.py; its count of OOM kills goes with the cgroups */
    remove_cgroups(f[F_CGROUP_PARENT], f[F_BOX]);
    if (remove_dir(f[F_STATE_DIR]) != 0)
        return -1;
    char rootfs[PATH_MAX];
    if (snprintf(rootfs, sizeof rootfs, "%s/rootfs", f[F_BOX_DIR]) >= (int)sizeof rootfs)
        return -1;
    unmount(rootfs);
    unmount(f[F_BOX_DIR]); /* the writable layer: its files go with it */
    if (remove_dir(f[F_BOX_DIR]) != 0)
        return -1;
    if (unlink(f[F_LOCK_PATH]) != 0 && errno != ENOENT)
        return -1;
    for (int i = 0; i < trees; i++) /* a release done twice (the finisher's) is a no-op */
        if (release_tree((int)tree_fds[i], t[i * N_TREE_FIELDS + T_LOCK_PATH],
                         t[i * N_TREE_FIELDS + T_TREE], f[F_LINGER], linger_s, python) != 0)
            return -1;
    /* Closed only now: the Python finisher, if it takes over, closes them itself, and
     * until the end a cleaner must see the sandbox and the trees held. */
    close((int)lock_fd);
    for (int i = 0; i < trees; i++)
        close((int)tree_fds[i]);
    return 0;
}
