/* A fault for the relay's data-path attack test (test_relay_data_attack.cpp),
 * LD_PRELOADed into one downstream relay: a downstream that is slow to open
 * its data connection. While SHMCAST_TEST_DATA_GATE names a file that does
 * not exist, ucp_ep_create() for a connection to a listener (a socket
 * address: the relay's data connection) first creates PATH.waiting, then
 * waits for PATH (at most 60 s), then goes on. The test opens the gate once
 * a keyless peer connected to the upstream's data listener first. Without
 * the variable, every call goes straight through. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

typedef ucs_status_t (*ep_create_fn)(ucp_worker_h, const ucp_ep_params_t*, ucp_ep_h*);

ucs_status_t ucp_ep_create(ucp_worker_h worker, const ucp_ep_params_t* params, ucp_ep_h* ep_p) {
  static ep_create_fn real = NULL;
  if (real == NULL) real = (ep_create_fn)dlsym(RTLD_NEXT, "ucp_ep_create");
  const char* gate = getenv("SHMCAST_TEST_DATA_GATE");
  if (gate != NULL && (params->field_mask & UCP_EP_PARAM_FIELD_SOCK_ADDR) && access(gate, F_OK) != 0) {
    char waiting[4096];
    snprintf(waiting, sizeof waiting, "%s.waiting", gate);
    const int fd = open(waiting, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd >= 0) close(fd);
    const struct timespec ms = {0, 1000000};
    for (int i = 0; i < 60000 && access(gate, F_OK) != 0; ++i) nanosleep(&ms, NULL);  /* a bounded wait on the gate */
  }
  return real(worker, params, ep_p);
}
