/* The sandbox ("pause") process of the private containerd's pause image (containerd.py), built
 * with `gcc -static` so the image needs no libc. As PID 1 of the pod it must exit on SIGTERM/SIGINT
 * (a signal with no handler is dropped for PID 1) and reap whatever gets re-parented to it. The
 * three signals stay blocked except inside sigsuspend(), so a signal that arrives between two
 * checks is never lost. */
#include <signal.h>
#include <stddef.h>
#include <sys/wait.h>

static volatile sig_atomic_t stopping;

static void on_stop(int sig) {
    (void)sig;
    stopping = 1;
}

static void on_child(int sig) { (void)sig; }

int main(void) {
    sigset_t blocked, waiting;
    struct sigaction sa = {0};

    sigemptyset(&blocked);
    sigaddset(&blocked, SIGTERM);
    sigaddset(&blocked, SIGINT);
    sigaddset(&blocked, SIGCHLD);
    sigprocmask(SIG_BLOCK, &blocked, &waiting);
    sigdelset(&waiting, SIGTERM);
    sigdelset(&waiting, SIGINT);
    sigdelset(&waiting, SIGCHLD);

    sa.sa_handler = on_stop;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sa.sa_handler = on_child;
    sigaction(SIGCHLD, &sa, NULL);

    while (!stopping) {
        sigsuspend(&waiting);
        while (waitpid(-1, NULL, WNOHANG) > 0) {
        }
    }
    return 0;
}
