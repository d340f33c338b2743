/* Stand-in for a node booted with the unified cgroup hierarchy alone, on a machine that mounts the
   cgroup v1 controllers too (tests/fleet's hosts). slurmd and slurmstepd 22.05 and 24.11 read
   /proc/PID/cgroup and refuse to run when it lists more than the unified line ("fatal: Hybrid
   mode is not supported"): 22.05 reads /proc/self/cgroup, 24.11 /proc/<pid>/cgroup (and compares
   it with /proc/<pid>/mountinfo). Preloaded into them (LD_PRELOAD), this shows them the "0::" line
   alone of any /proc/{self,thread-self,<pid>}/cgroup, as such a node's kernel would. Nothing else
   changes: the cgroups slurmstepd then makes, and where it puts each process, are the kernel's.
   Used by tests/fleet/test_slurm_checks_fleet.py. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static int filtered(const char *path)
{
	char buf[8192], *line, *save = NULL;
	ssize_t n;
	int src, fd;
	int (*real_open)(const char *, int, ...) = dlsym(RTLD_NEXT, "open");

	src = real_open(path, O_RDONLY | O_CLOEXEC);
	if (src < 0)
		return -1;
	n = read(src, buf, sizeof(buf) - 1);
	close(src);
	if (n < 0)
		return -1;
	buf[n] = '\0';
	fd = memfd_create("cgroup", MFD_CLOEXEC);
	if (fd < 0)
		return -1;
	for (line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		if (strncmp(line, "0::", 3) == 0) {
			if (write(fd, line, strlen(line)) < 0 || write(fd, "\n", 1) < 0)
				return -1;
		}
	}
	lseek(fd, 0, SEEK_SET);
	return fd;
}

static int is_proc_cgroup(const char *path)
{
	const char *p;

	if (!path || strncmp(path, "/proc/", 6) != 0)
		return 0;
	p = path + 6;
	if (strncmp(p, "self/", 5) == 0)
		p += 5;
	else if (strncmp(p, "thread-self/", 12) == 0)
		p += 12;
	else {
		if (*p < '0' || *p > '9')
			return 0;
		while (*p >= '0' && *p <= '9')
			p++;
		if (*p++ != '/')
			return 0;
	}
	return strcmp(p, "cgroup") == 0;
}

int open(const char *path, int flags, ...)
{
	static int (*real)(const char *, int, ...);
	mode_t mode = 0;
	va_list ap;
	if (!real)
		real = dlsym(RTLD_NEXT, "open");
	if (flags & (O_CREAT | O_TMPFILE)) {
		va_start(ap, flags);
		mode = va_arg(ap, mode_t);
		va_end(ap);
	}
	if (is_proc_cgroup(path))
		return filtered(path);
	return real(path, flags, mode);
}

int open64(const char *path, int flags, ...)
{
	static int (*real)(const char *, int, ...);
	mode_t mode = 0;
	va_list ap;
	if (!real)
		real = dlsym(RTLD_NEXT, "open64");
	if (flags & (O_CREAT | O_TMPFILE)) {
		va_start(ap, flags);
		mode = va_arg(ap, mode_t);
		va_end(ap);
	}
	if (is_proc_cgroup(path))
		return filtered(path);
	return real(path, flags, mode);
}

FILE *fopen(const char *path, const char *mode)
{
	static FILE *(*real)(const char *, const char *);
	if (!real)
		real = dlsym(RTLD_NEXT, "fopen");
	if (is_proc_cgroup(path)) {
		int fd = filtered(path);
		return fd < 0 ? NULL : fdopen(fd, mode);
	}
	return real(path, mode);
}
