#include "ferry/common/thread_name.h"

#include <pthread.h>

#include <cstring>
#include <string>

namespace ferry {

void set_thread_name(const char* name) {
    // Linux refuses names of 16 bytes or more (terminator included); keep the head.
    std::string n(name, strnlen(name, 15));
    pthread_setname_np(pthread_self(), n.c_str());
}

}  // namespace ferry
