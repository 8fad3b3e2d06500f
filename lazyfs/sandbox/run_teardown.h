/* The end of a `lazyfs run` in lazyfs-run-wait itself: run_teardown.c. */
#ifndef LAZYFS_RUN_TEARDOWN_H
#define LAZYFS_RUN_TEARDOWN_H

/* The finisher's fields, in lazyfs/sandbox/run_finish.py's FIELDS order; then, for each
 * of the F_TREES trees the sandbox stands on, TREE_FIELDS more (its TREE_FIELDS order). */
enum {
    F_BOX,
    F_BOX_DIR,
    F_STATE_DIR,
    F_LOCK_PATH,
    F_LOCK_FD,
    F_CGROUP_PARENT,
    F_LINGER,
    F_MEMORY,
    F_TREES,
    N_FIELDS
};
enum { T_TREE, T_LOCK_PATH, T_LOCK_FD, N_TREE_FIELDS };
#define MAX_TREES 512 /* more than overlayfs stacks (500, lazyfs/sandbox/overlay.py) */

/* How many fields `fields` holds (N_FIELDS plus the trees'), or -1 if F_TREES is not a
 * count of 1 to MAX_TREES; `fields` has at least N_FIELDS. */
int count_fields(char *const *fields);

/* Tear the sandbox down and release its trees as the Python finisher does. Returns 0 if
 * all is done (*status may have become 137: an OOM kill), or -1 at a case it leaves to
 * the Python finisher, which then starts over (each of its steps is idempotent) with
 * the same fields and *status. `python` is the interpreter the reaper runs on. */
int teardown(char *const *fields, const char *python, int *status);

#endif
