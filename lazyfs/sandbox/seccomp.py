"""The default seccomp profile of a sandbox, as data: an allow-list, everything else EPERM.

It has the semantics of containerd's and moby's default profile (written here from their
documented behaviour, not copied): ordinary system calls are allowed; calls that need a
capability the sandbox does not have (mount, module loading, kexec, bpf, clock setting,
reboot, swapon, keyctl, namespace creation through unshare/setns and namespace flags of
clone, ...) are not in the list and fail with EPERM, so the kernel refuses them before
any capability check is reached. clone3 gets ENOSYS (its flags live in memory that
seccomp cannot inspect) so that libc falls back to clone, whose flags are checked.

The runtime drops names its libseccomp does not know, so newer calls may be listed.
"""

from __future__ import annotations

import errno
import os

# Allowed on every architecture (names absent on one are ignored by the runtime).
_ALLOWED = """
accept accept4 access adjtimex alarm bind brk cachestat capget capset chdir chmod chown
chown32 clock_adjtime clock_adjtime64 clock_getres clock_getres_time64 clock_gettime
clock_gettime64 clock_nanosleep clock_nanosleep_time64 close close_range connect
copy_file_range creat dup dup2 dup3 epoll_create epoll_create1 epoll_ctl epoll_ctl_old
epoll_pwait epoll_pwait2 epoll_wait epoll_wait_old eventfd eventfd2 execve execveat exit
exit_group faccessat faccessat2 fadvise64 fadvise64_64 fallocate fanotify_mark fchdir
fchmod fchmodat fchmodat2 fchown fchown32 fchownat fcntl fcntl64 fdatasync fgetxattr
flistxattr flock fork fremovexattr fsetxattr fstat fstat64 fstatat64 fstatfs fstatfs64
fsync ftruncate ftruncate64 futex futex_requeue futex_time64 futex_wait futex_waitv
futex_wake futimesat getcpu getcwd getdents getdents64 getegid getegid32 geteuid
geteuid32 getgid getgid32 getgroups getgroups32 getitimer getpeername getpgid getpgrp
getpid getppid getpriority getrandom getresgid getresgid32 getresuid getresuid32
getrlimit get_robust_list getrusage getsid getsockname getsockopt get_thread_area gettid
gettimeofday getuid getuid32 getxattr inotify_add_watch inotify_init inotify_init1
inotify_rm_watch io_cancel ioctl io_destroy io_getevents io_pgetevents
io_pgetevents_time64 ioprio_get ioprio_set io_setup io_submit ipc kill landlock_add_rule
landlock_create_ruleset landlock_restrict_self lchown lchown32 lgetxattr link linkat
listen listxattr llistxattr _llseek lremovexattr lseek lsetxattr lstat lstat64 madvise
map_shadow_stack membarrier memfd_create mincore mkdir mkdirat mknod mknodat
mlock mlock2 mlockall mmap mmap2 mprotect mq_getsetattr mq_notify mq_open
mq_timedreceive mq_timedreceive_time64 mq_timedsend mq_timedsend_time64 mq_unlink
mremap msgctl msgget msgrcv msgsnd msync munlock munlockall munmap
nanosleep newfstatat _newselect open openat openat2 pause pidfd_open pidfd_send_signal
pipe pipe2 pkey_alloc pkey_free pkey_mprotect poll ppoll ppoll_time64 prctl pread64
preadv preadv2 prlimit64 process_mrelease pselect6 pselect6_time64 ptrace pwrite64
pwritev pwritev2 read readahead readlink readlinkat readv recv recvfrom recvmmsg
recvmmsg_time64 recvmsg remap_file_pages removexattr rename renameat renameat2
restart_syscall rmdir rseq rt_sigaction rt_sigpending rt_sigprocmask rt_sigqueueinfo
rt_sigreturn rt_sigsuspend rt_sigtimedwait rt_sigtimedwait_time64 rt_tgsigqueueinfo
sched_getaffinity sched_getattr sched_getparam sched_get_priority_max
sched_get_priority_min sched_getscheduler sched_rr_get_interval
sched_rr_get_interval_time64 sched_setaffinity sched_setattr sched_setparam
sched_setscheduler sched_yield seccomp select semctl semget semop semtimedop
semtimedop_time64 send sendfile sendfile64 sendmmsg sendmsg sendto setfsgid setfsgid32
setfsuid setfsuid32 setgid setgid32 setgroups setgroups32 setitimer setpgid setpriority
setregid setregid32 setresgid setresgid32 setresuid setresuid32 setreuid setreuid32
setrlimit set_robust_list setsid setsockopt set_thread_area set_tid_address setuid
setuid32 setxattr shmat shmctl shmdt shmget shutdown sigaltstack signalfd signalfd4
sigprocmask sigreturn socketcall splice stat stat64 statfs statfs64
statx symlink symlinkat sync sync_file_range syncfs sysinfo tee tgkill time timer_create
timer_delete timer_getoverrun timer_gettime timer_gettime64 timer_settime
timer_settime64 timerfd_create timerfd_gettime timerfd_gettime64 timerfd_settime
timerfd_settime64 times tkill truncate truncate64 ugetrlimit umask uname unlink unlinkat
utime utimensat utimensat_time64 utimes vfork vmsplice wait4 waitid waitpid write writev
"""
# containerd adds calls for each capability the container's bounding set holds; of its
# default set only CAP_SYS_CHROOT has one.
CAPABILITY_CALLS = ["chroot"]
COMMON = _ALLOWED.split() + CAPABILITY_CALLS

# ptrace is allowed as in moby's profile since kernel 4.8 (seccomp is re-checked after a
# tracer changes a call): it is how gdb and strace work, and it reaches only processes in
# the sandbox's own PID namespace, since no other is visible there.

PER_ARCH: dict[str, dict] = {
    "x86_64": {
        "architectures": ["SCMP_ARCH_X86_64"],
        "extra": ["arch_prctl", "modify_ldt"],
    },
    "aarch64": {
        "architectures": ["SCMP_ARCH_AARCH64"],
        "extra": [
            "arm_fadvise64_64",
            "arm_sync_file_range",
            "sync_file_range2",
            "breakpoint",
            "cacheflush",
            "set_tls",
        ],
    },
}

# clone's flags are its first argument on x86_64 and aarch64 (s390 differs; not supported).
NAMESPACE_FLAGS = (
    0x00020000  # CLONE_NEWNS
    | 0x04000000  # CLONE_NEWUTS
    | 0x08000000  # CLONE_NEWIPC
    | 0x10000000  # CLONE_NEWUSER
    | 0x20000000  # CLONE_NEWPID
    | 0x40000000  # CLONE_NEWNET
    | 0x02000000  # CLONE_NEWCGROUP
)

# socket(2) and socketpair(2) refuse AF_VSOCK (40), as moby's profile does: vsock has no
# network namespaces, so even a sandbox with a namespace of its own reached the
# hypervisor and every vsock listener of the VM through it (this VM has /dev/vsock).
# The calls are allowed when their first argument (the family) is not AF_VSOCK; the
# default action refuses the rest with EPERM. The other families were checked on this
# kernel (6.18) by trying all 46 from a default and a --network sandbox: only AF_UNIX,
# AF_INET, AF_INET6, AF_NETLINK, AF_PACKET and AF_XDP (both need CAP_NET_RAW) open, all
# of them per network namespace. Families that ignore namespaces on other kernels
# (AF_ALG, which is not networking) or exist only in the host's (bluetooth, NFC, LLC,
# X.25, AX.25: a --network sandbox reaches them, and socket() may load their modules)
# are not built here. An allow-list of families would close them too; not done, so that
# code using them still runs where they exist (an operator's choice, in docs/security.md).
AF_VSOCK = 40

# personality(2) values a program may set: Linux, its 32-bit variant, the two with
# UNAME26 (old software), and 0xffffffff (a query).
PERSONALITIES = (0x0, 0x0008, 0x20000, 0x20008, 0xFFFFFFFF)


def default_profile(machine: str | None = None) -> dict:
    """linux.seccomp for `machine` (default: this one, as `uname -m` says)."""
    machine = machine or os.uname().machine  # platform.machine(), without its import
    if machine not in PER_ARCH:
        raise ValueError(f"no seccomp profile for architecture {machine!r}")
    arch = PER_ARCH[machine]
    rules: list[dict] = [
        {"names": sorted(COMMON + arch["extra"]), "action": "SCMP_ACT_ALLOW"},
        {
            "names": ["clone"],
            "action": "SCMP_ACT_ALLOW",
            "args": [
                {"index": 0, "value": NAMESPACE_FLAGS, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}
            ],
        },
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS},
    ]
    rules.append(
        {
            "names": ["socket", "socketpair"],
            "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 0, "value": AF_VSOCK, "op": "SCMP_CMP_NE"}],
        }
    )
    for value in PERSONALITIES:
        rules.append(
            {
                "names": ["personality"],
                "action": "SCMP_ACT_ALLOW",
                "args": [{"index": 0, "value": value, "op": "SCMP_CMP_EQ"}],
            }
        )
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": errno.EPERM,
        "architectures": arch["architectures"],
        "syscalls": rules,
    }
