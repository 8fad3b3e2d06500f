/* The end of a `lazyfs run` in lazyfs-run-wait itself: run_teardown.c. */
#ifndef LAZYFS_RUN_TEARDOWN_H
#define LAZYFS_RUN_TEARDOWN_H

/* The finisher's fields, in lazyfs/sandbox/run_finish.py's FIELDS order. */
enum {
    F_BOX,
    F_BOX_DIR,
    F_STATE_DIR,
    F_LOCK_PATH,
    F_LOCK_FD,
    F_CGROUP_PARENT,
    F_TREE,
    F_TREE_LOCK_PATH,
    F_TREE_LOCK_FD,
    F_LINGER,
    F_MEMORY,
    N_FIELDS
};

/* Tear the sandbox down and release the tree as the Python finisher does. Returns 0 if
 * all is done (*status may have become 137: an OOM kill), or -1 at a case it leaves to
 * the Python finisher, which then starts over (each of its steps is idempotent) with
 * the same fields and *status. `python` is the interpreter the reaper runs on. */
int teardown(char *const *fields, const char *python, int *status);

#endif
