# `cmake --install`: libferry.so, the public headers, the `ferry` binary, the CMake package
# (find_package(ferry) -> ferry::ferry), ferry.pc and, when built, the Python package.
# Everything is placed relative to the prefix, so `cmake --install build --prefix DIR` works
# for any DIR chosen at install time.
include(CMakePackageConfigHelpers)

set(FERRY_CMAKE_INSTALL_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/ferry)

install(TARGETS ferry_shared EXPORT ferryTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(TARGETS ferry_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# include/ holds the public headers only (the serving stack's are in src/serve/).
install(DIRECTORY include/ferry DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  FILES_MATCHING PATTERN "*.h")

install(EXPORT ferryTargets NAMESPACE ferry:: DESTINATION ${FERRY_CMAKE_INSTALL_DIR})
configure_package_config_file(cmake/ferryConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/ferryConfig.cmake INSTALL_DESTINATION ${FERRY_CMAKE_INSTALL_DIR})
# 0.x: a minor release may change the API, so only the same minor version is compatible.
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/ferryConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/ferryConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/ferryConfigVersion.cmake DESTINATION ${FERRY_CMAKE_INSTALL_DIR})

# ferry.pc finds its prefix from its own location (${pcfiledir}), so it is right wherever the
# tree was installed.
file(RELATIVE_PATH FERRY_PC_TO_PREFIX "/prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/prefix")
string(REGEX REPLACE "/$" "" FERRY_PC_TO_PREFIX "${FERRY_PC_TO_PREFIX}")
set(FERRY_PC_CFLAGS)
foreach(def ${FERRY_PUBLIC_DEFINITIONS})
  string(APPEND FERRY_PC_CFLAGS " -D${def}")
endforeach()
# No Requires.private: only libferry.so is installed, which carries its private dependencies
# (cpp-httplib, OpenSSL) itself; naming cpp-httplib there made `pkg-config --cflags ferry` fail
# on a machine without its development package, which the headers never include.
configure_file(cmake/ferry.pc.in ${CMAKE_CURRENT_BINARY_DIR}/ferry.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/ferry.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
