/* A stand-in for Apptainer's starter (tests/sim/README.md): Apptainer itself is not installable on
 * these machines. What zeromib.gpu reads of a real instance, and this reproduces:
 *  - `apptainer instance start IMAGE NAME` execs root's starter (<libexecdir>/apptainer/bin/starter or
 *    starter-suid) with argv[0] "Apptainer instance: USER [NAME]" (apptainer's internal/pkg/instance,
 *    ProgPrefix and prognameFormat); the caller execs this binary the same way;
 *  - the starter stays as the instance's master, detached from the shell that started it (the CLI
 *    returns; the master's parent becomes PID 1 or the nearest subreaper, in a session of its own);
 *  - the container's process runs below the master, which waits for it and then exits.
 * Known difference: no container (no namespaces, no image); the container's process is
 * `/bin/sh -c "$ZEROMIB_STARTER_CMD"` as the caller's user (a real one gets its config through a pipe).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

int main(void)
{
    const char *cmd = getenv("ZEROMIB_STARTER_CMD");
    pid_t master, child;
    int status;

    if (cmd == NULL) {
        fprintf(stderr, "starter: ZEROMIB_STARTER_CMD is not set\n");
        return 2;
    }
    master = fork();
    if (master < 0)
        return 1;
    if (master > 0) {
        /* The CLI's side: the instance is started. */
        printf("%d\n", (int)master);
        return 0;
    }
    /* A daemon's streams (a real instance logs to files): the CLI's caller waits for no pipe. */
    status = open("/dev/null", O_RDWR);
    if (status >= 0) {
        dup2(status, 0);
        dup2(status, 1);
        dup2(status, 2);
        if (status > 2)
            close(status);
    }
    setsid();
    child = fork();
    if (child < 0)
        _exit(1);
    if (child == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    while (waitpid(child, &status, 0) < 0 && errno == EINTR)
        ;
    _exit(WIFEXITED(status) ? WEXITSTATUS(status) : 1);
}
