"""One sandbox on an OCI runtime, and `lazyfs run`.

    oci_spec.py   the runtime's config.json, a pure function of what the sandbox needs
    seccomp.py    the default seccomp profile, as data
    limits.py     limits from text (flags, API fields) and the node's reserves
    process.py    what the sandbox runs: the image config's Env, WorkingDir and User
    runtime.py    bundle, cgroup, `runc create/start/delete`: from nothing to nothing left
    run.py        `lazyfs run`: one command in a fresh sandbox of an image
    run_wait.py   its hand-over to the waiter (run_wait.c) and the node's run slots
    run_finish.py its last step: the OOM message, the sandbox deleted, the tree released
    teardown.py   a sandbox taken off the host (runtime.py's delete and run_finish.py)
The node agent (lazyfs/agent/) keeps sandboxes made by runtime.py resident.
"""
