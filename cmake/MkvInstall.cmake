# Install rules and the package config consumed by find_package(managedkv).
include(CMakePackageConfigHelpers)

set(MKV_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/managedkv)
set(_mkv_install_targets managedkv managedkv_events managedkv_remote)
if(TARGET managedkv_testing)
  list(APPEND _mkv_install_targets managedkv_testing)
endif()

# The include directory reaches the export once, through the targets' INSTALL_INTERFACE.
install(TARGETS ${_mkv_install_targets} EXPORT managedkvTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/mkv DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT managedkvTargets NAMESPACE managedkv:: DESTINATION ${MKV_INSTALL_CMAKEDIR})

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/managedkvConfig.cmake.in
  ${PROJECT_BINARY_DIR}/managedkvConfig.cmake INSTALL_DESTINATION ${MKV_INSTALL_CMAKEDIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/managedkvConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/managedkvConfig.cmake
              ${PROJECT_BINARY_DIR}/managedkvConfigVersion.cmake
        DESTINATION ${MKV_INSTALL_CMAKEDIR})
