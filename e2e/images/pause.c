/*
 * The pod sandbox process (ferry.local/pause): holds the pod's namespaces
 * while its containers come and go. Like Kubernetes' build/pause/linux/pause.c:
 * exits 0 on SIGINT or SIGTERM, and reaps every child that exits, which
 * matters when it is PID 1 of a pod that shares its process namespace
 * (orphans are reparented to it). Built with gcc -static: the image holds
 * nothing but this binary.
 */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define VERSION "3.10"

static void on_stop(int sig) {
  static const char msg[] = "pause: shutting down\n";
  (void)sig;
  (void)!write(STDERR_FILENO, msg, sizeof msg - 1);
  _exit(0);
}

static void on_child(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(int argc, char **argv) {
  struct sigaction stop, child;

  if (argc > 1 && strcmp(argv[1], "-v") == 0) {
    printf("pause.c %s (ferry)\n", VERSION);
    return 0;
  }
  if (getpid() != 1) {
    fprintf(stderr, "pause: warning: not PID 1\n");
  }

  memset(&stop, 0, sizeof stop);
  stop.sa_handler = on_stop;
  sigemptyset(&stop.sa_mask);
  if (sigaction(SIGINT, &stop, NULL) < 0 || sigaction(SIGTERM, &stop, NULL) < 0) {
    perror("pause: sigaction");
    return 1;
  }

  memset(&child, 0, sizeof child);
  child.sa_handler = on_child;
  child.sa_flags = SA_NOCLDSTOP | SA_RESTART;
  sigemptyset(&child.sa_mask);
  if (sigaction(SIGCHLD, &child, NULL) < 0) {
    perror("pause: sigaction");
    return 1;
  }

  for (;;) {
    pause();
  }
}
