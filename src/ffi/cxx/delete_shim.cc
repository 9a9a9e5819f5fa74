// Pre-v6 callers of CopyToRemoteDevice allocated the two descriptor
// out-pointers with C++ `new` and expected the plugin to `delete` them.
#include <cstddef>

extern "C" void pjrt_crosshost_cxx_delete_descriptor_pointers(char** data,
                                                              size_t* size) {
  delete data;
  delete size;
}
