/* plugin_roundtrip.c — a plain C host of the plugin, as a framework would be.
 *
 * Usage: plugin_roundtrip /path/to/libpjrt_crosshost.so
 *
 * dlopens the library, calls GetPjrtApi, checks the API version, creates a
 * client, lists its devices, round-trips an f32 buffer (and copies it to a
 * second device when there is one) and a zero-sized buffer, checks every
 * byte, and destroys everything. Exit 0 on success; non-zero with a message
 * on stderr on the first failure. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "xla/pjrt/c/pjrt_c_api.h"

static const PJRT_Api* api;

static void fail(const char* what) {
  fprintf(stderr, "plugin_roundtrip: FAILED: %s\n", what);
  exit(1);
}

/* Reports and destroys a PJRT_Error; exits when it is non-NULL. */
static void check(PJRT_Error* err, const char* fn) {
  if (err == NULL) return;
  PJRT_Error_GetCode_Args code = {0};
  code.struct_size = PJRT_Error_GetCode_Args_STRUCT_SIZE;
  code.error = err;
  PJRT_Error* code_err = api->PJRT_Error_GetCode(&code);
  PJRT_Error_Message_Args msg = {0};
  msg.struct_size = PJRT_Error_Message_Args_STRUCT_SIZE;
  msg.error = err;
  api->PJRT_Error_Message(&msg);
  fprintf(stderr, "plugin_roundtrip: FAILED: %s returned error code %d: %.*s\n", fn,
          code_err ? -1 : (int)code.code, (int)msg.message_size,
          msg.message ? msg.message : "");
  exit(1);
}

static void await_and_destroy(PJRT_Event* ev, const char* what) {
  if (ev == NULL) return;
  PJRT_Event_Await_Args aw = {0};
  aw.struct_size = PJRT_Event_Await_Args_STRUCT_SIZE;
  aw.event = ev;
  check(api->PJRT_Event_Await(&aw), what);
  PJRT_Event_Destroy_Args d = {0};
  d.struct_size = PJRT_Event_Destroy_Args_STRUCT_SIZE;
  d.event = ev;
  check(api->PJRT_Event_Destroy(&d), "PJRT_Event_Destroy");
}

static PJRT_Buffer* from_host(PJRT_Client* client, PJRT_Device* device, const void* data,
                              const int64_t* dims, size_t num_dims) {
  PJRT_Client_BufferFromHostBuffer_Args a = {0};
  a.struct_size = PJRT_Client_BufferFromHostBuffer_Args_STRUCT_SIZE;
  a.client = client;
  a.data = data;
  a.type = PJRT_Buffer_Type_F32;
  a.dims = dims;
  a.num_dims = num_dims;
  a.host_buffer_semantics = PJRT_HostBufferSemantics_kImmutableUntilTransferCompletes;
  a.device = device;
  check(api->PJRT_Client_BufferFromHostBuffer(&a), "PJRT_Client_BufferFromHostBuffer");
  if (a.buffer == NULL) fail("BufferFromHostBuffer returned a NULL buffer");
  await_and_destroy(a.done_with_host_buffer, "await done_with_host_buffer");
  return a.buffer;
}

/* Reads a buffer back: size query (dst = NULL), then the copy. Returns a
 * malloc'ed block (at least 1 byte) and its size. */
static unsigned char* to_host(PJRT_Buffer* buf, size_t* size_out) {
  PJRT_Buffer_ToHostBuffer_Args q = {0};
  q.struct_size = PJRT_Buffer_ToHostBuffer_Args_STRUCT_SIZE;
  q.src = buf;
  q.dst = NULL;
  check(api->PJRT_Buffer_ToHostBuffer(&q), "PJRT_Buffer_ToHostBuffer (size query)");
  if (q.event) await_and_destroy(q.event, "await size-query event");
  size_t size = q.dst_size;
  unsigned char* dst = malloc(size ? size : 1);
  if (!dst) fail("malloc");
  memset(dst, 0xA5, size ? size : 1);
  PJRT_Buffer_ToHostBuffer_Args t = {0};
  t.struct_size = PJRT_Buffer_ToHostBuffer_Args_STRUCT_SIZE;
  t.src = buf;
  t.dst = dst;
  t.dst_size = size;
  check(api->PJRT_Buffer_ToHostBuffer(&t), "PJRT_Buffer_ToHostBuffer");
  if (t.event == NULL) fail("ToHostBuffer returned no event");
  await_and_destroy(t.event, "await ToHostBuffer event");
  *size_out = size;
  return dst;
}

static void destroy_buffer(PJRT_Buffer* buf) {
  PJRT_Buffer_Destroy_Args d = {0};
  d.struct_size = PJRT_Buffer_Destroy_Args_STRUCT_SIZE;
  d.buffer = buf;
  check(api->PJRT_Buffer_Destroy(&d), "PJRT_Buffer_Destroy");
}

static void compare(const unsigned char* got, size_t got_size, const void* want,
                    size_t want_size, const char* what) {
  if (got_size != want_size) {
    fprintf(stderr, "plugin_roundtrip: FAILED: %s: size %zu, expected %zu\n", what, got_size,
            want_size);
    exit(1);
  }
  for (size_t i = 0; i < want_size; i++) {
    if (got[i] != ((const unsigned char*)want)[i]) {
      fprintf(stderr, "plugin_roundtrip: FAILED: %s: byte %zu is 0x%02x, expected 0x%02x\n",
              what, i, got[i], ((const unsigned char*)want)[i]);
      exit(1);
    }
  }
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s /path/to/libpjrt_crosshost.so\n", argv[0]);
    return 2;
  }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    fprintf(stderr, "plugin_roundtrip: FAILED: dlopen(%s): %s\n", argv[1], dlerror());
    return 1;
  }
  typedef const PJRT_Api* (*GetPjrtApiFn)(void);
  GetPjrtApiFn get = (GetPjrtApiFn)dlsym(lib, "GetPjrtApi");
  if (!get) fail("GetPjrtApi is not exported");
  api = get();
  if (!api) fail("GetPjrtApi returned NULL");
  if (api->struct_size != PJRT_Api_STRUCT_SIZE) fail("PJRT_Api.struct_size != PJRT_Api_STRUCT_SIZE");
  if (api->pjrt_api_version.major_version != PJRT_API_MAJOR ||
      api->pjrt_api_version.minor_version != PJRT_API_MINOR) {
    fprintf(stderr, "plugin_roundtrip: FAILED: API version %d.%d, header is %d.%d\n",
            api->pjrt_api_version.major_version, api->pjrt_api_version.minor_version,
            PJRT_API_MAJOR, PJRT_API_MINOR);
    return 1;
  }

  PJRT_Plugin_Initialize_Args init = {0};
  init.struct_size = PJRT_Plugin_Initialize_Args_STRUCT_SIZE;
  check(api->PJRT_Plugin_Initialize(&init), "PJRT_Plugin_Initialize");

  PJRT_Client_Create_Args cc = {0};
  cc.struct_size = PJRT_Client_Create_Args_STRUCT_SIZE;
  check(api->PJRT_Client_Create(&cc), "PJRT_Client_Create");
  if (!cc.client) fail("PJRT_Client_Create returned a NULL client");
  PJRT_Client* client = cc.client;

  PJRT_Client_PlatformName_Args pn = {0};
  pn.struct_size = PJRT_Client_PlatformName_Args_STRUCT_SIZE;
  pn.client = client;
  check(api->PJRT_Client_PlatformName(&pn), "PJRT_Client_PlatformName");
  if (pn.platform_name_size != 9 || memcmp(pn.platform_name, "crosshost", 9) != 0)
    fail("platform name is not \"crosshost\"");

  PJRT_Client_Devices_Args devs = {0};
  devs.struct_size = PJRT_Client_Devices_Args_STRUCT_SIZE;
  devs.client = client;
  check(api->PJRT_Client_Devices(&devs), "PJRT_Client_Devices");
  if (devs.num_devices < 1 || devs.devices == NULL) fail("client has no devices");
  for (size_t i = 0; i < devs.num_devices; i++) {
    PJRT_Device_GetDescription_Args gd = {0};
    gd.struct_size = PJRT_Device_GetDescription_Args_STRUCT_SIZE;
    gd.device = devs.devices[i];
    check(api->PJRT_Device_GetDescription(&gd), "PJRT_Device_GetDescription");
    PJRT_DeviceDescription_Id_Args id = {0};
    id.struct_size = PJRT_DeviceDescription_Id_Args_STRUCT_SIZE;
    id.device_description = gd.device_description;
    check(api->PJRT_DeviceDescription_Id(&id), "PJRT_DeviceDescription_Id");
    PJRT_DeviceDescription_ToString_Args ts = {0};
    ts.struct_size = PJRT_DeviceDescription_ToString_Args_STRUCT_SIZE;
    ts.device_description = gd.device_description;
    check(api->PJRT_DeviceDescription_ToString(&ts), "PJRT_DeviceDescription_ToString");
    printf("device %zu: id=%d %.*s\n", i, id.id, (int)ts.to_string_size,
           ts.to_string ? ts.to_string : "");
    if (id.id != (int)i) fail("device ids are not 0..n-1");
  }

  /* f32 [3, 4] round trip. */
  float data[12];
  for (int i = 0; i < 12; i++) data[i] = (float)i * 1.5f - 7.25f;
  int64_t dims[2] = {3, 4};
  PJRT_Buffer* buf = from_host(client, devs.devices[0], data, dims, 2);
  size_t got_size = 0;
  unsigned char* got = to_host(buf, &got_size);
  compare(got, got_size, data, sizeof data, "f32[3,4] round trip");
  free(got);

  if (devs.num_devices >= 2) {
    PJRT_Buffer_CopyToDevice_Args cp = {0};
    cp.struct_size = PJRT_Buffer_CopyToDevice_Args_STRUCT_SIZE;
    cp.buffer = buf;
    cp.dst_device = devs.devices[1];
    check(api->PJRT_Buffer_CopyToDevice(&cp), "PJRT_Buffer_CopyToDevice");
    if (!cp.dst_buffer) fail("CopyToDevice returned a NULL buffer");
    got = to_host(cp.dst_buffer, &got_size);
    compare(got, got_size, data, sizeof data, "f32[3,4] copied to device 1");
    free(got);
    destroy_buffer(cp.dst_buffer);
  }
  destroy_buffer(buf);

  /* Zero-sized f32 [0, 5]. */
  int64_t zdims[2] = {0, 5};
  float dummy = 0.0f;
  PJRT_Buffer* zbuf = from_host(client, devs.devices[0], &dummy, zdims, 2);
  PJRT_Buffer_Dimensions_Args dm = {0};
  dm.struct_size = PJRT_Buffer_Dimensions_Args_STRUCT_SIZE;
  dm.buffer = zbuf;
  check(api->PJRT_Buffer_Dimensions(&dm), "PJRT_Buffer_Dimensions");
  if (dm.num_dims != 2 || dm.dims[0] != 0 || dm.dims[1] != 5) fail("zero-sized dims wrong");
  got = to_host(zbuf, &got_size);
  compare(got, got_size, &dummy, 0, "f32[0,5] round trip");
  free(got);
  destroy_buffer(zbuf);

  PJRT_Client_Destroy_Args cd = {0};
  cd.struct_size = PJRT_Client_Destroy_Args_STRUCT_SIZE;
  cd.client = client;
  check(api->PJRT_Client_Destroy(&cd), "PJRT_Client_Destroy");

  printf("plugin_roundtrip: OK\n");
  return 0;
}
